"""The router's prefix index: which blocks each replica probably caches (a leading run
of chained keys, forgotten least recently used first, a prompt's tail before its
prefix, at most the replica's KV pool), and the keys themselves: chained per full
block, stable across processes whatever their hash seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.cluster_view import ClusterView
from router.prefix_index import PrefixIndex, block_keys
from router.replica_info import ReplicaInfo


def test_prefix_index_leading_run_and_lru():
    index = PrefixIndex(capacity_blocks=4)
    a = block_keys(list(range(64)), 16)  # 4 blocks
    index.insert("r1", a[:3])
    assert index.num_matched_blocks("r1", a) == 3
    assert index.num_matched_blocks("r2", a) == 0
    b = block_keys([7] * 32, 16)
    index.insert("r1", b)  # evicts a's last block: a prompt's tail goes first, as in the engine
    assert index.num_blocks("r1") == 4
    assert index.num_matched_blocks("r1", a) == 2 and index.num_matched_blocks("r1", b) == 2
    index.insert("r1", a[:1])  # touched again: b's tail goes, then a's second block
    index.insert("r1", block_keys([9] * 32, 16))
    assert index.num_matched_blocks("r1", a) == 1 and index.num_matched_blocks("r1", b) == 1
    index.retain(["r2"])
    assert index.num_blocks("r1") == 0


def test_prefix_index_holds_at_most_each_replicas_pool():
    index = PrefixIndex(capacity_blocks=100)
    a = block_keys(list(range(160)), 16)  # 10 blocks
    index.insert("r1", a)
    index.insert("r2", a)
    index.set_capacity("r1", 4)  # trims at once, the tail first
    assert index.num_blocks("r1") == 4 and index.num_matched_blocks("r1", a) == 4
    assert index.num_matched_blocks("r2", a) == 10
    index.insert("r1", a)
    assert index.num_matched_blocks("r1", a) == 4
    index.set_capacity("r1", None)  # unknown again: the default
    index.insert("r1", a)
    assert index.num_matched_blocks("r1", a) == 10
    index.set_capacity("r1", 4)
    index.retain(["r1"])
    index.retain(["r2"])  # r1 is gone, and with it its pool size: back with the default
    index.insert("r1", a)
    assert index.num_matched_blocks("r1", a) == 10


def test_cluster_view_sizes_each_replica_by_its_heartbeats_kv_pool():
    view = ClusterView(block_size=16, max_num_seqs=8)
    stats = [{"kv_blocks_total": 3}, {"kv_blocks_total": "many"}, {}]
    view.update([ReplicaInfo(f"r{i}", "decode", stats=s) for i, s in enumerate(stats)])
    a = block_keys(list(range(160)), 16)
    for rid in ("r0", "r1", "r2"):
        view.index.insert(rid, a)
    assert [view.index.num_matched_blocks(r, a) for r in ("r0", "r1", "r2")] == [3, 10, 10]


@settings(max_examples=200, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=6), min_size=1, max_size=30),
       capacity=st.integers(1, 12))
def test_prefix_index_is_closed_under_prefixes_so_bisection_finds_the_leading_run(prompts, capacity):
    """Prompts of blocks from a small alphabet share prefixes; however they are inserted
    and evicted, a replica holds each prompt's blocks as a leading run, and the bisection
    finds exactly the run a scan block by block finds."""
    index = PrefixIndex(capacity_blocks=capacity)
    keyed = [block_keys([t for b in blocks for t in [b] * 4], 4) for blocks in prompts]
    for keys in keyed:
        index.insert("r", keys[: len(keys) // 2 + 1])
        held = index.held_blocks["r"]
        for other in keyed:
            run = next((i for i, k in enumerate(other) if k not in held), len(other))
            assert not any(k in held for k in other[run:])
            assert index.num_matched_blocks("r", other) == run


def test_block_keys_chain_whole_prefixes_and_leave_out_the_partial_tail():
    prompt = list(range(1000, 1070))  # 4 full blocks of 16, a partial tail of 6
    keys = block_keys(prompt, 16)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert block_keys(prompt[:64] + [1, 2, 3], 16) == keys  # the tail never counts
    assert block_keys(prompt + list(range(40)), 16)[:4] == keys  # a longer prompt extends the chain
    changed = prompt[:20] + [0] + prompt[21:]  # one token of block 1
    other = block_keys(changed, 16)
    assert other[0] == keys[0] and all(a != b for a, b in zip(other[1:], keys[1:], strict=True))
    moved = prompt[16:32] + prompt[:16] + prompt[32:]  # the same blocks in another order
    assert block_keys(moved, 16)[1] != keys[1]
    assert block_keys(prompt[:15], 16) == [] and block_keys([5] * 32, 16)[0] != block_keys([5] * 32, 16)[1]
    with pytest.raises(ValueError):
        block_keys(prompt, 0)


def test_block_keys_agree_across_processes_whatever_their_hash_seed():
    """Every router replica and the planner key the same prompt alike: no per-process
    salt (PYTHONHASHSEED) reaches them."""
    prompt = [7, 150_000, 0, 42] * 12
    script = ("import json, sys; from router.prefix_index import block_keys; "
              "print(json.dumps(block_keys(json.loads(sys.argv[1]), 16)))")
    for seed in ("1", "4242"):
        out = subprocess.run([sys.executable, "-c", script, json.dumps(prompt)], capture_output=True, text=True,
                             check=True, env={**os.environ, "PYTHONHASHSEED": seed})
        assert json.loads(out.stdout) == block_keys(prompt, 16)


def test_the_planners_simulated_cache_forgets_in_the_same_order():
    """The planner's replica cache and the router's index model the same engine cache:
    a prompt's tail is forgotten before its prefix in both."""
    from cluster.plan.sim.prefix_cache import SimPrefixCache

    cache, index = SimPrefixCache(capacity_blocks=4), PrefixIndex(capacity_blocks=4)
    a, b, c = (block_keys([t] * 48, 16) for t in (1, 2, 3))  # 3 blocks each
    for keys in (a, b):
        cache.insert(keys)
        index.insert("r", keys)
    assert cache.match(b, 3) == index.num_matched_blocks("r", b) == 3
    assert cache.match(a, 3) == index.num_matched_blocks("r", a) == 1
    for keys in (b, a[:1], c[:1]):  # a hit touches the blocks it found, as placing the prompt does
        index.insert("r", keys)
    cache.insert(c[:1])
    assert cache.match(b, 3) == index.num_matched_blocks("r", b) == 2
