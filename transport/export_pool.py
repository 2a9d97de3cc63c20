"""A sender's pool of reusable host buffers that the prefill engine exports layers into.

Why: the export copy (`copy_from_blocks`) used to write every layer into a fresh tensor. A
fresh allocation of 32 MiB or more is a fresh `mmap` (glibc keeps no free chunk that big),
so each export of a large layer page-faulted its whole destination: 256 MiB of 32 MiB
layers took ~190 ms to export against ~13 ms to hash. Lent from here, a steady stream of
large exports lands in memory that is already mapped.

Life of a buffer: `lend` -> the engine copies one layer into `lease.buffer` -> the sender
sends it -> the lease is settled exactly once, by whichever comes first of
- `release()`: nothing reads the buffer any more; it is free again at once;
- `release_when(done)`: it is free again once `done()` is true (a zmq `MessageTracker`
  whose zero-copy frames libzmq may still be reading); checked on every `lend`;
- `discard()`: something may still read it (a send that failed part-way): the pool
  forgets it, and the memory goes when its last reader lets go.

Bound: the buffers the pool owns, free or lent, never add up to more than `POOL_LAYERS`
buffers for the largest layer it was asked for, nor to `MAX_POOL_BYTES` (one long prompt's
layers in flight at once beyond that are rare: the sender keeps pace with prefill). Past
it, `lend` answers None and the caller allocates a fresh tensor, as before the pool:
layers beyond the bound cost page faults, never a wait. Layers under `MIN_POOLED_BYTES`
are not pooled: malloc already reuses blocks that small.

Giving memory back: a buffer that has sat free (not lent, not draining) for more than
`IDLE_S` is dropped from the pool on the next `lend` or settle, so an idle prefill worker
does not keep up to the bound (4 x 128 MiB after a 32k-token prompt of an 8B model) for
hours. No thread does this: the pool trims when it is used anyway (every exported layer
lends, even one too small to pool), so the last buffers freed before a quiet spell stay
until the next lend or settle after `IDLE_S` (at the latest, when the sender goes). A
buffer still lent or draining is never dropped, however old. A dropped buffer of 32 MiB or
more goes back to the OS as soon as nothing else refers to it (glibc `munmap`s chunks that
big); a smaller one goes back to malloc, which reuses it or trims it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

MIN_POOLED_BYTES = 1 << 20
POOL_LAYERS = 4
MAX_POOL_BYTES = 1 << 30
MAX_WASTE = 2  # a free buffer serves a layer of at least 1/MAX_WASTE of its size
IDLE_S = 30.0  # a buffer free for longer than this is dropped: its memory goes back

Done = Callable[[], bool]


def size_class(nbytes: int) -> int:
    """`nbytes` rounded up to an eighth of its power of two (at most 12.5 % more), so a
    layer a few blocks longer than the last still fits the buffer the last one used."""
    step = 1 << max(nbytes.bit_length() - 4, 0)
    return -(-nbytes // step) * step


class ExportLease:
    """One buffer lent by an `ExportPool`. `buffer` is a contiguous uint8 tensor of exactly
    the bytes asked for; settle the lease once (further calls are no-ops)."""

    def __init__(self, pool: ExportPool, storage: torch.Tensor, nbytes: int) -> None:
        self._pool = pool
        self.storage = storage  # the pooled allocation (`size_class` bytes or more)
        self.buffer = storage[:nbytes]
        self.settled = False  # guarded by the pool's lock

    def release(self) -> None:
        self._pool.settle(self, _always)

    def release_when(self, done: Done) -> None:
        self._pool.settle(self, done)

    def discard(self) -> None:
        self._pool.settle(self, None)


class _NoLease(ExportLease):
    """The lease of a layer that is in memory of its own: nothing to settle."""

    def __init__(self) -> None:  # no pool, no buffer
        self.settled = True

    def release(self) -> None:
        return None

    def release_when(self, done: Done) -> None:
        return None

    def discard(self) -> None:
        return None


NO_LEASE: ExportLease = _NoLease()


def _always() -> bool:
    return True


class SinkLender:
    """One sink's end of the pool: the buffer lent for the layer being exported, paired
    with the tensor `on_layer` then receives (the engine asks, copies, and hands the layer
    over, in that order, on its step thread)."""

    def __init__(self, pool: ExportPool) -> None:
        self._pool = pool
        self._lent = NO_LEASE

    def lend(self, nbytes: int) -> torch.Tensor | None:
        self.drop_unclaimed()
        lease = self._pool.lend(nbytes)
        self._lent = lease or NO_LEASE
        return None if lease is None else lease.buffer

    def claim(self, kv: torch.Tensor) -> ExportLease:
        """The lease `kv` lives in, or `NO_LEASE`; a lent buffer `kv` did not use goes back."""
        lease, self._lent = self._lent, NO_LEASE
        if lease is not NO_LEASE and kv.data_ptr() != lease.buffer.data_ptr():
            lease.release()
            return NO_LEASE
        return lease

    def drop_unclaimed(self) -> None:
        """Give back a buffer whose layer never reached `on_layer` (its export failed)."""
        lease, self._lent = self._lent, NO_LEASE
        lease.release()


class ExportPool:
    """Thread-safe: the engine's step thread lends, sender threads settle."""

    def __init__(self, min_bytes: int = MIN_POOLED_BYTES, pool_layers: int = POOL_LAYERS,
                 max_pool_bytes: int = MAX_POOL_BYTES, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_bytes, self.pool_layers, self.max_pool_bytes = min_bytes, pool_layers, max_pool_bytes
        self.idle_s, self._clock = idle_s, clock
        self._lock = threading.Lock()
        self._free: list[tuple[float, torch.Tensor]] = []  # (freed at, buffer), oldest-freed first
        self._lent: dict[int, ExportLease] = {}  # by id(); includes the draining ones
        self._draining: dict[int, Done] = {}  # settled with `release_when`, not yet done
        self._largest = 0  # the size class of the largest layer asked for
        self.num_allocated = self.num_reused = self.num_fallbacks = 0

    @property
    def max_bytes(self) -> int:
        return min(self.max_pool_bytes, self.pool_layers * self._largest)

    def lend(self, nbytes: int) -> ExportLease | None:
        """A buffer of `nbytes`, or None: too small to pool, or the pool is at its bound."""
        with self._lock:
            self._reap()
            self._trim()  # on small layers too: short prompts after a long one still trim
            if nbytes < self.min_bytes:
                return None
            self._largest = max(self._largest, size_class(nbytes))
            storage = self._take_free(nbytes)
            if storage is None:
                storage = self._allocate(nbytes)
            if storage is None:
                self.num_fallbacks += 1
                return None
            lease = ExportLease(self, storage, nbytes)
            self._lent[id(lease)] = lease
            return lease

    def settle(self, lease: ExportLease, done: Done | None) -> None:
        """End `lease`: back once `done()` is true, or forgotten if `done` is None."""
        with self._lock:
            self._trim()
            if lease.settled or self._lent.get(id(lease)) is not lease:
                return
            lease.settled = True
            if done is None:
                del self._lent[id(lease)]
            elif done():
                self._give_back(lease)
            else:
                self._draining[id(lease)] = done

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._reap()
            return {"num_free": len(self._free), "num_lent": len(self._lent),
                    "num_draining": len(self._draining), "bytes_owned": self._bytes_owned(),
                    "max_bytes": self.max_bytes, "num_allocated": self.num_allocated,
                    "num_reused": self.num_reused, "num_fallbacks": self.num_fallbacks}

    def check_integrity(self) -> None:
        """Within the bound; no buffer both free and lent, or lent twice."""
        with self._lock:
            assert self._bytes_owned() <= self.max_bytes, "pool past its bound"
            ptrs = [s.data_ptr() for _, s in self._free]
            ptrs += [lease.storage.data_ptr() for lease in self._lent.values()]
            assert len(set(ptrs)) == len(ptrs), "a buffer is free and lent, or lent twice"
            assert set(self._draining) <= set(self._lent), "a draining buffer is not lent"
            freed_ats = [t for t, _ in self._free]
            assert freed_ats == sorted(freed_ats), "free buffers out of the order they were freed"

    # -- under the lock ------------------------------------------------------------------------

    def _reap(self) -> None:
        for key in [k for k, done in self._draining.items() if done()]:
            self._give_back(self._lent[key])

    def _give_back(self, lease: ExportLease) -> None:
        del self._lent[id(lease)]
        self._draining.pop(id(lease), None)
        self._free.append((self._clock(), lease.storage))

    def _trim(self) -> None:
        """Drop the buffers free for longer than `idle_s` (the oldest-freed come first)."""
        expired_before = self._clock() - self.idle_s
        while self._free and self._free[0][0] < expired_before:
            self._free.pop(0)

    def _take_free(self, nbytes: int) -> torch.Tensor | None:
        """The smallest free buffer that fits without wasting more than half of it (the
        most recently freed of equals: the likeliest still in cache)."""
        fits = [i for i, (_, s) in enumerate(self._free) if nbytes <= s.numel() <= MAX_WASTE * nbytes]
        if not fits:
            return None
        best = min(fits, key=lambda i: (self._free[i][1].numel(), -i))
        self.num_reused += 1
        return self._free.pop(best)[1]

    def _allocate(self, nbytes: int) -> torch.Tensor | None:
        """A new buffer, dropping the oldest free ones to make room; None past the bound."""
        size = size_class(nbytes)
        while self._free and self._bytes_owned() + size > self.max_bytes:
            self._free.pop(0)
        if self._bytes_owned() + size > self.max_bytes:
            return None
        self.num_allocated += 1
        return torch.empty(size, dtype=torch.uint8)

    def _bytes_owned(self) -> int:
        lent = sum(lease.storage.numel() for lease in self._lent.values())
        return lent + sum(s.numel() for _, s in self._free)
