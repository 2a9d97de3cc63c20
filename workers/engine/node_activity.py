"""How busy the other engines on this machine were during a step, from a board they share.

Engines on one node compete for its cores and memory bandwidth: on a small box a long
prefill on one replica slows another replica's decode steps nearly as much as if it ran
there, which no replica's own step records show. Each engine keeps one slot of a small
node-wide shared-memory board (a file under /dev/shm, mode 0600): its cumulative busy
seconds and, while it steps, since when. A step reads the other slots' busy seconds at
its start and at its end; their growth over the step's length is the step's `node_busy`,
the mean number of other engines computing during it (0 alone; 1 when another one
stepped the whole time). Reads and writes are a few aligned float64s, no lock: a torn
read misplaces a few microseconds of someone's busy time.

A slot belongs to (pid, token): a slot whose process is gone is free again, so a
crashed replica's slot does not count as busy forever.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import secrets
import tempfile
import time
from pathlib import Path

import numpy as np

NUM_SLOTS = 64
SWEEP_EVERY_S = 5.0  # how often a slot of a process that is gone is freed (a crash mid-step)
FIELDS = 4  # pid, token, busy seconds before the current step, start of the current step (0: idle)
PID, TOKEN, BUSY_S, SINCE = range(FIELDS)


def board_path(node_id: str, directory: str | None = None) -> Path:
    """The node's board: one per node id (hashed, so no id leaks into a file name)."""
    where = Path(directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()))
    digest = hashlib.blake2b(node_id.encode(), digest_size=8).hexdigest()
    return where / f"pdc-node-activity-{digest}"


class NodeActivity:
    """This engine's slot on its node's board; `begin` / `end` bracket each step."""

    def __init__(self, node_id: str, directory: str | None = None) -> None:
        self.path = board_path(node_id, directory)
        self._token = float(secrets.randbits(52))
        size = NUM_SLOTS * FIELDS * 8
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                with _locked(fd):
                    if os.fstat(fd).st_nlink == 0:
                        continue  # the last engine removed it meanwhile: open the new one
                    if os.fstat(fd).st_size < size:
                        os.ftruncate(fd, size)
                    self._map = mmap.mmap(fd, size)
                    self._board = np.ndarray((NUM_SLOTS, FIELDS), dtype=np.float64, buffer=self._map)
                    self._slot = self._claim()
                    self._inode = os.fstat(fd).st_ino
                    break
            finally:
                os.close(fd)
        self._begin_others = 0.0
        self._begin_at = 0.0
        self._next_sweep = time.monotonic() + SWEEP_EVERY_S
        self._closed = False

    def _claim(self) -> int:
        for slot in range(NUM_SLOTS):
            pid = int(self._board[slot, PID])
            if pid == 0 or not _alive(pid):
                self._board[slot] = (os.getpid(), self._token, 0.0, 0.0)
                return slot
        raise RuntimeError(f"the node activity board {self.path} has no free slot ({NUM_SLOTS} engines)")

    def begin(self) -> None:
        """This engine starts a step."""
        if self._closed:
            return
        now = time.monotonic()
        self._begin_at, self._begin_others = now, self._others_busy_s(now)
        self._board[self._slot, SINCE] = now

    def end(self) -> float:
        """This engine ends the step: the mean number of other engines busy during it."""
        if self._closed:
            return 0.0
        now = time.monotonic()
        row = self._board[self._slot]
        row[BUSY_S] += now - row[SINCE]
        row[SINCE] = 0.0
        if now >= self._next_sweep:
            self._sweep(now)
        elapsed = now - self._begin_at
        if elapsed <= 0:
            return 0.0
        return max(0.0, (self._others_busy_s(now) - self._begin_others) / elapsed)

    def _others_busy_s(self, now: float) -> float:
        board = self._board
        live = board[:, PID] != 0
        live[self._slot] = False
        busy = board[live, BUSY_S]
        since = board[live, SINCE]
        return float(busy.sum() + np.where(since > 0, now - since, 0.0).sum())

    def _sweep(self, now: float) -> None:
        self._next_sweep = now + SWEEP_EVERY_S
        for slot in np.flatnonzero(self._board[:, PID]):
            if not _alive(int(self._board[slot, PID])):
                self._board[slot] = 0.0

    def close(self) -> None:
        """Give the slot back (only if it is still this engine's); the last engine of the
        node removes the board. The mapping stays until the process ends: a step still
        running on another thread may end after this."""
        if self._closed:
            return
        self._closed = True
        try:
            fd = os.open(self.path, os.O_RDWR)
        except FileNotFoundError:
            return
        try:
            with _locked(fd):
                if self._board[self._slot, TOKEN] == self._token:
                    self._board[self._slot] = 0.0
                if os.fstat(fd).st_ino == self._inode and not self._board[:, PID].any():
                    os.unlink(self.path)
        finally:
            os.close(fd)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True  # another engine of this process (tests)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _locked(fd: int):
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
