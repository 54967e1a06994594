"""The layout search: the method (pure) and its run on real cores."""
