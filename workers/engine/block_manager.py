"""Block allocator with reference counts and a prefix cache of full blocks.

A block is free when no sequence holds it. Free blocks wait in an LRU queue; a free
block that held a full, hashed block keeps its hash (and stays findable by the prefix
cache) until the queue hands it out again, which is when it is evicted. A prefix-cache
hit is verified against the stored token ids, so a hash collision can never serve wrong
KV. Sequences release their blocks tail first, so a prefix outlives its suffixes.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from workers.engine.kv_types import num_blocks
from workers.engine.sequence import Sequence


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set while this block is the cache entry for a hash
    token_ids: tuple[int, ...] = ()  # the tokens behind block_hash, to reject collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached_blocks: dict[int, int] = {}  # block hash -> block id
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Extra blocks `seq` needs to hold KV for its first `num_tokens` tokens."""
        return max(0, num_blocks(num_tokens, self.block_size) - len(seq.block_ids))

    # -- prefix cache ------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> int:
        """Give `seq` (holding no blocks) its cached leading blocks; returns tokens hit.

        Capped at `num_tokens - 1` tokens so the last token is always computed and
        yields the logits to sample from. The caller records the query once it sticks.
        """
        assert not seq.block_ids, "match_prefix needs a sequence without blocks"
        hit_ids = self._lookup(seq, (seq.num_tokens - 1) // self.block_size)
        self._take(hit_ids)
        seq.block_ids = hit_ids
        seq.num_hashed_blocks = len(hit_ids)
        seq.num_computed_tokens = seq.num_cached_tokens = len(hit_ids) * self.block_size
        return seq.num_computed_tokens

    def record_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Prefix-cache statistics, both in tokens."""
        self.num_queried_tokens += num_tokens
        self.num_hit_tokens += num_hit_tokens

    def _lookup(self, seq: Sequence, max_blocks: int) -> list[int]:
        if not self.enable_prefix_caching:
            return []
        hit_ids: list[int] = []
        for i in range(max_blocks):
            block_id = self.cached_blocks.get(seq.block_hash(i, self.block_size))
            if block_id is None or self.blocks[block_id].token_ids != tuple(seq.block_tokens(i, self.block_size)):
                break
            hit_ids.append(block_id)
        return hit_ids

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register every block of `seq` whose tokens are all computed (idempotent)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_ids))
        for i in range(seq.num_hashed_blocks, num_full):
            self._register(seq.block_ids[i], seq.block_hash(i, self.block_size),
                           tuple(seq.block_tokens(i, self.block_size)))
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def _register(self, block_id: int, block_hash: int, token_ids: tuple[int, ...]) -> None:
        if block_hash in self.cached_blocks:
            return  # the same prefix was computed twice; the first copy stays the entry
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached_blocks[block_hash] = block_id

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to cover `num_tokens` tokens; False (and no change) if full."""
        num_new = self.blocks_needed(seq, num_tokens)
        if num_new == 0:  # most decode steps: the last block still has room
            return True
        if num_new > self.num_free_blocks:
            return False
        seq.block_ids.extend(self._pop_free() for _ in range(num_new))
        return True

    def allocate_ids(self, num_blocks: int) -> list[int] | None:
        if num_blocks > self.num_free_blocks:
            return None
        return [self._pop_free() for _ in range(num_blocks)]

    def fork(self, parent: Sequence, child: Sequence) -> int | None:
        """Give `child` (holding no blocks) `parent`'s computed KV: every full block shared
        by reference, and a fresh block for the partial last one, where the two will
        diverge; returns that block's id for the caller to copy the KV into (None when
        there is none). With no free block for it, the child takes only the full blocks
        and recomputes the few tokens after them."""
        assert not child.block_ids, "fork needs a child without blocks"
        num_full = parent.num_computed_tokens // self.block_size
        shared = parent.block_ids[:num_full]
        self._take(shared)
        child.block_ids = list(shared)
        child.num_hashed_blocks = min(parent.num_hashed_blocks, num_full)
        child.num_computed_tokens = num_full * self.block_size
        if child.num_computed_tokens == parent.num_computed_tokens or not self.free_queue:
            return None
        copy_id = self._pop_free()
        child.block_ids.append(copy_id)
        child.num_computed_tokens = parent.num_computed_tokens
        return copy_id

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks at once, tail first."""
        self.release(seq.block_ids)
        seq.block_ids = []
        seq.num_hashed_blocks = 0

    def release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def _take(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free_queue[block_id]
            block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        assert block.ref_count == 0, f"free block {block_id} has ref_count {block.ref_count}"
        self._evict(block)
        block.ref_count = 1
        return block_id

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) == block.block_id:
                del self.cached_blocks[block.block_hash]
            block.block_hash, block.token_ids = None, ()

    # -- invariants ----------------------------------------------------------------------

    def check_integrity(self, held: Iterable[list[int]]) -> None:
        """Assert the pool is consistent with the block tables of every holder."""
        holders = Counter()
        for block_ids in held:
            assert len(set(block_ids)) == len(block_ids), f"a holder lists a block twice: {block_ids}"
            holders.update(block_ids)
        num_used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert num_used + self.num_free_blocks == self.num_blocks, "free + used != total"
        for block in self.blocks:
            assert block.ref_count == holders[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count} != holders {holders[block.block_id]}")
            assert (block.ref_count == 0) == (block.block_id in self.free_queue), (
                f"block {block.block_id}: ref_count {block.ref_count} but free={block.block_id in self.free_queue}")
        for block_hash, block_id in self.cached_blocks.items():
            assert self.blocks[block_id].block_hash == block_hash, f"hash map points at wrong block {block_id}"
