"""The inference job runtime: the job process, dynamic batcher, instance workers, offline runner."""
