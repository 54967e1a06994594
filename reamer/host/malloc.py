"""glibc malloc settings for processes that handle large buffers over and over (the job process).

A request body or an offline input of a few hundred KB is above glibc's mmap threshold until the
threshold adapts, and freed memory at the top of the heap is given back once it passes the trim
threshold: either way the next buffer of that size is fresh memory, and touching it costs a page
fault per 4 KB page. On a VM that was ~0.5 ms per 600 KB request body (bench/RESULTS.md).
"""
from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def keep_large_buffers(mmap_threshold: int = 32 << 20, trim_threshold: int = 128 << 20) -> bool:
    """Serve allocations up to `mmap_threshold` from the heap and keep up to `trim_threshold` of freed
    heap memory for reuse. False where this is not glibc (nothing changed)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(M_TRIM_THRESHOLD, trim_threshold))
