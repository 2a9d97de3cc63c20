"""A simulated replica's prefix cache: block hashes in LRU order, as many as its KV pool.

The engine keeps a full block's hash findable until the free queue hands the block out
again (workers/engine/block_manager.py); under steady load that is about the last
`num_kv_blocks` blocks computed, which is what this keeps. A prompt's blocks are
touched tail first, as the engine releases a sequence's blocks, so a prefix outlives
its suffixes there as here. It sees the same chained
keys as the router's `PrefixIndex` (`router.prefix_index.block_keys`), so
affinity the real placement code finds is a hit here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SimPrefixCache:
    def __init__(self, capacity_blocks: int, enabled: bool = True) -> None:
        self.capacity_blocks = capacity_blocks
        self.enabled = enabled
        self._held: OrderedDict[int, None] = OrderedDict()
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    def match(self, hashes: Sequence[int], max_blocks: int) -> int:
        """Leading blocks of `hashes` held, at most `max_blocks` (the last prompt token is
        always computed); touches them, tail first."""
        if not self.enabled:
            return 0
        n = 0
        for h in hashes[:max_blocks]:
            if h not in self._held:
                break
            n += 1
        for h in reversed(hashes[:n]):
            self._held.move_to_end(h)
        return n

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def insert(self, hashes: Sequence[int]) -> None:
        """A computed prompt's full blocks become findable, its first block the most recent."""
        if not self.enabled:
            return
        held, touch = self._held, self._held.move_to_end
        for h in reversed(hashes):
            if h in held:
                touch(h)
            else:
                held[h] = None
        while len(held) > self.capacity_blocks:
            held.popitem(last=False)
