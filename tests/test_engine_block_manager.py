"""The allocator and the prefix hash on their own: ref counts, LRU eviction, collision
rejection, the last-token cap, and hashes that agree across processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.engine.block_manager import BlockManager
from workers.engine.prefix_hash import block_hashes, hash_block
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import Sequence

BS = 4


def seq(token_ids, request_id="r") -> Sequence:
    return Sequence(request_id, list(token_ids), SamplingParams(), seed=0)


def admit(manager: BlockManager, s: Sequence) -> int:
    """Prefix lookup, then blocks for the whole prompt, then mark it computed and cached."""
    hit = manager.match_prefix(s)
    assert manager.allocate(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    manager.cache_full_blocks(s)
    return hit


def test_block_hashes_cover_full_blocks_only_and_chain():
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 2
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    assert block_hashes([9] + tokens[1:], BS)[1] != hashes[1], "a block's hash must cover its prefix"
    assert block_hashes(tokens[:3], BS) == []


def test_block_hashes_agree_across_processes():
    tokens = list(range(0, 3000, 7))
    code = ("import json,sys; from workers.engine.prefix_hash import block_hashes; "
            f"print(json.dumps(block_hashes({tokens!r}, 16)))")
    results = []
    for hash_seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": hash_seed}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout))
    assert results[0] == results[1] == block_hashes(tokens, 16)
    assert "torch" not in subprocess.run(
        [sys.executable, "-c", "import sys, workers.engine.prefix_hash; print(sorted(sys.modules))"],
        capture_output=True, text=True, check=True).stdout, "the router must import this without torch"


def test_hit_is_capped_so_the_last_token_is_recomputed():
    manager = BlockManager(16, BS)
    first = seq(range(8), "a")
    admit(manager, first)
    again = seq(range(8), "b")
    assert manager.match_prefix(again) == 4  # not 8: the last token must yield logits
    longer = seq(range(9), "c")
    assert manager.match_prefix(longer) == 8
    manager.check_integrity([first.block_ids, again.block_ids, longer.block_ids])
    assert manager.blocks[first.block_ids[0]].ref_count == 3


def test_freed_blocks_stay_cached_until_lru_eviction():
    manager = BlockManager(4, BS)
    a = seq(range(8), "a")
    admit(manager, a)
    manager.free(a)
    assert manager.num_free_blocks == 4
    probe = seq(range(9), "b")
    assert manager.match_prefix(probe) == 8  # still cached while free
    manager.check_integrity([probe.block_ids])


def test_lru_evicts_tail_blocks_before_prefix_blocks():
    manager = BlockManager(4, BS)
    a = seq(range(8), "a")
    admit(manager, a)
    manager.free(a)  # free queue now: unused 2, unused 3, then a's tail, then a's head
    other = seq(range(100, 112), "o")  # needs 3 blocks: takes both unused and a's tail
    assert manager.match_prefix(other) == 0 and manager.allocate(other, 12)
    probe = seq(list(range(8)) + [0], "p")
    assert manager.match_prefix(probe) == 4, "the head block must have outlived the tail"
    manager.check_integrity([other.block_ids, probe.block_ids])


def test_hash_collision_is_rejected_by_the_token_check():
    manager = BlockManager(8, BS)
    a = seq(range(8), "a")
    admit(manager, a)
    head = manager.blocks[a.block_ids[0]]
    head.token_ids = (99, 99, 99, 99)  # as if another prefix had produced the same hash
    assert manager.match_prefix(seq(range(9), "b")) == 0


def test_free_and_double_free_and_integrity():
    manager = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq(range(10), "a")
    assert manager.match_prefix(a) == 0 and manager.allocate(a, 10)
    assert len(a.block_ids) == 3 and manager.num_free_blocks == 5
    assert not manager.allocate(seq(range(30)), 30) and manager.num_free_blocks == 5
    manager.check_integrity([a.block_ids])
    with pytest.raises(AssertionError):
        manager.check_integrity([])  # the pool says a's blocks are held; nobody claims them
    ids = list(a.block_ids)
    manager.free(a)
    with pytest.raises(AssertionError, match="double free"):
        manager.release(ids)


@settings(max_examples=200, deadline=None)
@given(token_ids=st.lists(st.integers(0, 2**40), max_size=200), block_size=st.integers(1, 32))
def test_prompt_hashes_are_the_chain_of_block_hashes(token_ids, block_size):
    """`block_hashes` packs the prompt once; its hashes are `hash_block`'s, block by block."""
    from workers.engine.prefix_hash import ROOT_HASH

    chained, parent = [], ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        chained.append(parent)
    assert block_hashes(token_ids, block_size) == chained
    assert block_hashes(tuple(token_ids), block_size) == chained
