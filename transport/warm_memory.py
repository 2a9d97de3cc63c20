"""Keep freed receive buffers in the process, so the next layer lands in warm pages.

libzmq mallocs every received frame, and process-group receives allocate a tensor per
layer. glibc serves a block above its mmap threshold (128 KiB at start, raised only after
such a block is freed) with a fresh `mmap` and returns freed heap tops to the kernel, so
each multi-MiB layer faults its pages in again: about 4,000 page faults and ~5 ms of the
receiving I/O thread's CPU per 64 MiB were measured, on the path that paces the transfer.

Fixing both thresholds keeps blocks up to 32 MiB (glibc's ceiling for the mmap threshold)
in the heap and up to `TRIM_THRESHOLD` of free heap mapped. It is process-wide and done
once, by the receiving side only; without glibc (e.g. musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import threading

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 512 << 20

_lock = threading.Lock()
_done: list[bool] = []


def keep_freed_memory_warm() -> bool:
    """Tune glibc malloc once per process; True if it is (now or already) tuned."""
    with _lock:
        if not _done:
            _done.append(_tune())
        return _done[0]


def _tune() -> bool:
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
