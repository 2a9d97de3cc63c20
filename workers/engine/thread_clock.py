"""Where a step's wall time went, as the kernel saw the thread that ran it.

A step's wall time is the thread's time on a CPU, plus its time runnable but waiting for
one (other processes on the node's cores), plus its time blocked (the interpreter lock
held by another thread of the process, a lock, I/O). Linux counts the first two per
thread: the CPU time exactly (`time.thread_time`, which brings the running thread's
count up to date; the on-CPU field of schedstat lags by up to a scheduler tick), the
run-queue wait in nanoseconds (`/proc/thread-self/schedstat`, second field; it reads 0
where there is no such file).

A step record carries the first two, so a fit can tell the work a step did from the
machine it shared (see `cost_model`), and a diagnosis can tell a slow engine from a
crowded node.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

SCHEDSTAT = "/proc/thread-self/schedstat"


@dataclass(frozen=True)
class ThreadTimes:
    """Seconds this thread has been on a CPU and runnable but waiting for one."""

    cpu_s: float
    wait_s: float

    def __sub__(self, other: ThreadTimes) -> ThreadTimes:
        return ThreadTimes(self.cpu_s - other.cpu_s, self.wait_s - other.wait_s)


class ThreadClock:
    """Reads the calling thread's `ThreadTimes` (about 2 us a read: one open file per
    thread, kept, read from its start)."""

    def __init__(self, path: str = SCHEDSTAT) -> None:
        self._path = path
        self._local = threading.local()

    def read(self) -> ThreadTimes:
        cpu_s, handle = time.thread_time(), self._handle()
        if handle is None:
            return ThreadTimes(cpu_s, 0.0)
        handle.seek(0)
        return ThreadTimes(cpu_s, int(handle.read().split()[1]) * 1e-9)

    def _handle(self):
        """This thread's open schedstat file (None where there is none). The file names
        the thread that opened it, so each thread opens its own."""
        if not hasattr(self._local, "handle"):
            try:
                self._local.handle = open(self._path, "rb", buffering=0)  # noqa: SIM115 (kept open)
            except OSError:
                self._local.handle = None
        return self._local.handle
