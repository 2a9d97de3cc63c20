"""What each replica's prefix cache probably holds, as the router saw it.

The router records a key per full block of every prompt it sends to a replica
(`block_keys`) and forgets the least recently used ones past a capacity, as the engines'
caches do. It never asks a replica, so routing costs no extra hop; a wrong guess only
costs some recomputation, never correctness: the engines find their cached blocks by
their own collision-resistant hashes (`workers.engine.prefix_hash`).
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
    def __init__(self, capacity_blocks: int = 65536) -> None:
        assert capacity_blocks >= 1
        self.capacity_blocks = capacity_blocks
        self._blocks: dict[str, OrderedDict[int, None]] = {}

    def num_matched_blocks(self, replica_id: str, hashes: Sequence[int]) -> int:
        """Length of the leading run of `hashes` that `replica_id` holds (chained hashes:
        a later block can only be valid when every earlier one is)."""
        held = self._blocks.get(replica_id)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    @property
    def held_blocks(self) -> Mapping[str, Container[int]]:
        """Replica id -> the block hashes it holds, to scan many replicas without a call
        each (read only)."""
        return self._blocks

    def holds(self, replica_id: str, block_hash: int) -> bool:
        """Whether `replica_id` holds this one block (not necessarily the blocks before it)."""
        held = self._blocks.get(replica_id)
        return held is not None and block_hash in held

    def insert(self, replica_id: str, hashes: Sequence[int]) -> None:
        held = self._blocks.setdefault(replica_id, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)

    def retain(self, replica_ids: Iterable[str]) -> None:
        """Forget replicas that are gone (a restarted replica starts with an empty cache)."""
        keep = set(replica_ids)
        for replica_id in list(self._blocks):
            if replica_id not in keep:
                del self._blocks[replica_id]

    def num_blocks(self, replica_id: str) -> int:
        return len(self._blocks.get(replica_id, ()))
