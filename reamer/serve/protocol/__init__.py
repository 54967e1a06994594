"""The Open Inference Protocol as reamer speaks it: wire formats, tensors, Triton's model config and statistics."""
