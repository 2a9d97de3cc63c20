"""Keep freed host memory in the process, so the next step's tensors land in warm pages.

glibc serves a block above its mmap threshold (128 KiB at start, raised only after such a
block is freed) with a fresh `mmap`, and returns freed heap tops to the kernel, so a
multi-MiB allocation faults its pages in again each time it is made. Two things pay that:
- the engine: every step allocates its activations afresh (a 1,024-token prefill of the
  `small` preset made 10,000-48,000 page faults a step, 0.40-0.43 s; tuned, under 10
  faults and 0.35-0.36 s);
- the transport's receiver: libzmq mallocs every received frame and process-group
  receives allocate a tensor per layer (about 4,000 faults and ~5 ms of the receiving
  I/O thread's CPU per 64 MiB, on the path that paces the transfer).

Fixing both thresholds keeps blocks up to 32 MiB (glibc's ceiling for the mmap threshold)
in the heap and up to `TRIM_THRESHOLD` of free heap mapped. It is process-wide and done
once; without glibc (e.g. musl) it does nothing.
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
