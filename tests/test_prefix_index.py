"""The router's prefix index: which blocks each replica probably caches (a leading run
of chained keys, forgotten least recently used first), and the keys themselves: chained
per full block, stable across processes whatever their hash seed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from router.prefix_index import PrefixIndex, block_keys


def test_prefix_index_leading_run_and_lru():
    index = PrefixIndex(capacity_blocks=4)
    a = block_keys(list(range(64)), 16)  # 4 blocks
    index.insert("r1", a[:3])
    assert index.num_matched_blocks("r1", a) == 3
    assert index.num_matched_blocks("r2", a) == 0
    b = block_keys([7] * 32, 16)
    index.insert("r1", b)  # evicts the two oldest of a
    assert index.num_blocks("r1") == 4
    assert index.num_matched_blocks("r1", a) == 0  # the chain's first block is gone
    index.retain(["r2"])
    assert index.num_blocks("r1") == 0


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
