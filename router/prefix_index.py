"""What each replica's prefix cache probably holds, as the router saw it.

The router records a key per full block of every prompt it sends to a replica
(`block_keys`) and forgets the least recently used ones past a capacity, as the engines'
caches do: a prompt's blocks are touched tail first, as the engines release them, so a
block is never more recent than the blocks before it and a prefix outlives its
suffixes. What a replica holds is then closed under prefixes, and the leading run of a
prompt's keys it holds is found by bisection.

It never asks a replica, so routing costs no extra hop; a wrong guess only costs some
recomputation, never correctness: the engines find their cached blocks by their own
collision-resistant hashes (`workers.engine.prefix_hash`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Mapping, Sequence


def block_keys(token_ids: Sequence[int], block_size: int) -> list[int]:
    """A chained key per FULL block of `token_ids` (a partial tail is left out): equal
    keys mean, with high probability, equal whole prefixes. Python's hash of a tuple of
    ints, which no per-process salt changes: the router keys every request's prompt,
    and this is about a third of the time of the engines' blake2b chain. Not
    collision-resistant against crafted prompts; a collision only misplaces a request
    (its replica recomputes what it lacks), and only this process compares the keys."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    end = len(token_ids) // block_size * block_size
    keys: list[int] = []
    key = 0
    for start in range(0, end, block_size):
        key = hash((key, *token_ids[start:start + block_size]))
        keys.append(key)
    return keys


class PrefixIndex:
    """Per replica, the block keys its prefix cache probably holds, least recently used
    first; at most its KV pool's blocks (`set_capacity`, from its heartbeat), else
    `capacity_blocks`."""

    def __init__(self, capacity_blocks: int = 65536) -> None:
        assert capacity_blocks >= 1
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}

    def num_matched_blocks(self, replica_id: str, hashes: Sequence[int]) -> int:
        """Length of the leading run of `hashes` that `replica_id` holds (chained hashes:
        a later block can only be valid when every earlier one is). What it holds is
        closed under prefixes (`insert`), so holding block i means holding those before
        it: a bisection, a few lookups where a scan took one per block of a long hit."""
        held = self._blocks.get(replica_id)
        if not held or not hashes or hashes[0] not in held:
            return 0
        known, most = 1, len(hashes)  # it holds the first `known`; the run is at most `most`
        while known < most:
            mid = (known + most + 1) // 2
            if hashes[mid - 1] in held:
                known = mid
            else:
                most = mid - 1
        return known

    @property
    def held_blocks(self) -> Mapping[str, Container[int]]:
        """Replica id -> the block hashes it holds, to scan many replicas without a call
        each (read only)."""
        return self._blocks

    def holds(self, replica_id: str, block_hash: int) -> bool:
        """Whether `replica_id` holds this one block (and so, its keys being chained, the
        blocks before it)."""
        held = self._blocks.get(replica_id)
        return held is not None and block_hash in held

    def set_capacity(self, replica_id: str, num_blocks: int | None) -> None:
        """`replica_id`'s KV pool, in blocks (None: unknown, `capacity_blocks`): its cache
        never holds more, so neither does its entry here. An engine keeps a block's hash
        until the pool hands the block out again; remembered past that, a replica whose
        pool had turned over looked to hold a prompt it had long evicted."""
        if num_blocks is None or num_blocks < 1:
            self._capacity.pop(replica_id, None)
        else:
            self._capacity[replica_id] = num_blocks
        held = self._blocks.get(replica_id)
        if held is not None:
            self._trim(replica_id, held)

    def insert(self, replica_id: str, hashes: Sequence[int]) -> None:
        held = self._blocks.setdefault(replica_id, OrderedDict())
        for h in reversed(hashes):  # tail first: each block ends up more recent than those after it
            held[h] = None
            held.move_to_end(h)
        self._trim(replica_id, held)

    def _trim(self, replica_id: str, held: OrderedDict[int, None]) -> None:
        capacity = self._capacity.get(replica_id, self.capacity_blocks)
        while len(held) > capacity:
            held.popitem(last=False)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone (a restarted replica starts with an empty cache)."""
        keep = set(replica_ids)
        for table in (self._blocks, self._capacity):
            for replica_id in [r for r in table if r not in keep]:
                del table[replica_id]

    def num_blocks(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))
