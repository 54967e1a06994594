"""Fakes for what no machine here has: the MPS control binary and the NVML library."""
