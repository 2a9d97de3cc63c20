"""The SDPA backend's attention equals dense attention computed token by token from each
sequence's own context, on random paged layouts: fragmented and contiguous block tables,
ragged lengths, prefix-cached starts, decodes read in place beside padded groups, and
several sequences' prompt chunks in one call."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from workers.engine.attention import AttentionMetadata
from workers.engine.attention_plan import (
    IN_PLACE_MIN_TOKENS,
    MAX_PADDING_WASTE,
    SeqWork,
    _padded_area,
    _real_area,
    group_by_padding,
    plan_step,
)
from workers.engine.kv_cache import KVCache
from workers.engine.kv_types import KVLayout
from workers.engine.sdpa_backend import SdpaBackend

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_BLOCKS = 4, 6, 2, 8, 1024
SCALE = HEAD_DIM ** -0.5


def make_cache() -> KVCache:
    layout = KVLayout("test", 1, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, "float32")
    cache = KVCache(layout, NUM_BLOCKS, torch.device("cpu"))
    cache.layers[0].normal_(generator=torch.Generator().manual_seed(1))
    return cache


def random_tables(rng: random.Random, context_lens: list[int]) -> list[list[int]]:
    """Each table: a contiguous head (sometimes) then blocks drawn one at a time."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = []
    for context_len in context_lens:
        need = -(-context_len // BLOCK_SIZE)
        head = rng.choice([0, need // 2, need])
        start = rng.randrange(0, NUM_BLOCKS - head) if head else 0
        run = [b for b in range(start, start + head) if b in free][:head]
        for b in run:
            free.remove(b)
        tables.append(run + [free.pop() for _ in range(need - len(run))])
    return tables


def step_meta(cache: KVCache, query_lens: list[int], context_lens: list[int], tables: list[list[int]]):
    starts = [0, *itertools.accumulate(query_lens)][:-1]
    slots = [tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for i in range(len(query_lens)) for p in range(context_lens[i] - query_lens[i], context_lens[i])]
    return AttentionMetadata(cache, SdpaBackend(), torch.tensor(slots, dtype=torch.long), starts, query_lens,
                             context_lens, tables)


def dense_reference(cache: KVCache, meta: AttentionMetadata, query: torch.Tensor) -> torch.Tensor:
    """float64, one sequence at a time, keys read token by token from the (already written) cache."""
    slots = cache.slots_view(0).double()
    out = torch.empty_like(query, dtype=torch.float64)
    for i in range(meta.num_seqs):
        ctx, length, start = meta.context_lens[i], meta.query_lens[i], meta.query_start_locs[i]
        idx = torch.tensor([meta.block_tables[i][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx)])
        k = slots[0][idx].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)  # [ctx, heads, dim]
        v = slots[1][idx].repeat_interleave(NUM_HEADS // NUM_KV_HEADS, 1)
        q = query[start:start + length].double()
        scores = torch.einsum("lhd,chd->hlc", q, k) * SCALE
        q_pos = torch.arange(ctx - length, ctx)[:, None]
        scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, float("-inf"))
        out[start:start + length] = torch.einsum("hlc,chd->lhd", scores.softmax(-1), v)
    return out


def run_step(query_lens, context_lens, seed=0, in_place=None):
    rng = random.Random(seed)
    cache = make_cache()
    tables = random_tables(rng, context_lens)
    meta = step_meta(cache, query_lens, context_lens, tables)
    meta.backend = SdpaBackend(in_place)
    gen = torch.Generator().manual_seed(seed)
    n = sum(query_lens)
    query, key, value = (torch.randn(n, h, HEAD_DIM, generator=gen) for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS))
    meta.backend.prepare(meta)
    out = meta.backend.forward(0, query, key, value, meta, SCALE)
    return out, dense_reference(cache, meta, query), meta


CASES = {
    "decodes_ragged": ([1] * 9, [1, 3, 4, 5, 17, 130, 200, 257, 300]),  # few tokens in all: padded
    "decodes_ragged_in_place": ([1] * 9, [1, 3, 4, 5, 17, 130, 200, 257, 600]),
    "long_decodes": ([1] * 4, [128, 400, 401, 512]),
    "prefill_chunks_together": ([5, 7, 6, 8], [5, 7, 6, 8]),
    "one_prompt_from_start": ([101], [101]),
    "prefix_cached_chunks": ([3, 9, 16, 1], [40, 9, 120, 33]),
    "mixed_step": ([1, 1, 30, 1, 12, 1], [300, 2, 30, 700, 60, 129]),
}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("in_place", [None, False])  # None: in place on CPU; False: all padded (GPU default)
def test_backend_equals_dense_attention(name, seed, in_place):
    out, ref, meta = run_step(*CASES[name], seed=seed, in_place=in_place)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    decoded = sum(c for q, c in zip(*CASES[name], strict=True) if q == 1)
    assert (meta.backend_state.plan.in_place is not None) == (decoded >= IN_PLACE_MIN_TOKENS and in_place is not False)


def test_every_query_is_planned_once_and_chunks_share_calls():
    _, _, meta = run_step(*CASES["mixed_step"])
    plan = meta.backend_state.plan
    tokens = [t for g in plan.groups for t in g.tokens.tolist()] + plan.in_place.tokens.tolist()
    assert sorted(tokens) == list(range(sum(meta.query_lens)))
    _, _, meta = run_step(*CASES["prefill_chunks_together"])
    assert len(meta.backend_state.plan.groups) == 1


def test_chunks_from_position_0_use_the_causal_rule_and_others_a_mask():
    _, _, meta = run_step(*CASES["prefill_chunks_together"])
    assert [g.mask for g in meta.backend_state.plan.groups] == [None]
    _, _, meta = run_step([5, 7], [5, 9])  # one group: the second chunk follows a cached prefix
    assert [g.mask is None for g in meta.backend_state.plan.groups] == [False]


def test_written_kv_lands_in_the_scheduled_slots_only():
    cache = make_cache()
    before = cache.layers[0].clone()
    meta = step_meta(cache, [2, 1], [6, 200], random_tables(random.Random(3), [6, 200]))
    key = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    meta.backend.prepare(meta)
    meta.backend.forward(0, torch.randn(3, NUM_HEADS, HEAD_DIM), key, key, meta, SCALE)
    changed = (cache.slots_view(0) != before.view(2, -1, NUM_KV_HEADS, HEAD_DIM)).any(-1).any(-1).any(0)
    assert changed.nonzero().flatten().tolist() == sorted(meta.slot_mapping.tolist())


@pytest.mark.parametrize("seed", range(5))
def test_in_place_pattern_scores_each_context_exactly_once(seed):
    rng = random.Random(seed)
    context_lens = [rng.randrange(1, 300) for _ in range(6)] + [IN_PLACE_MIN_TOKENS]
    tables = random_tables(rng, context_lens)
    works = [SeqWork(i, 1, c, t) for i, (c, t) in enumerate(zip(context_lens, tables, strict=True))]
    decode = plan_step(works, BLOCK_SIZE, torch.device("cpu")).in_place
    pattern = decode.pattern(NUM_HEADS, NUM_KV_HEADS, torch.float32)
    group = NUM_HEADS // NUM_KV_HEADS
    for h in range(NUM_HEADS):
        for i, (context, table) in enumerate(zip(context_lens, tables, strict=True)):
            row = i * NUM_HEADS + h
            first, end = pattern.crow[row].item(), pattern.crow[row + 1].item()
            slots = [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context)]
            assert pattern.col[first:end].tolist() == [slot * NUM_KV_HEADS + h // group for slot in slots]
            width = decode.grid_width
            assert pattern.grid_index[first:end].tolist() == list(range(row * width, row * width + context))
    assert decode.pattern(NUM_HEADS, NUM_KV_HEADS, torch.float32) is pattern  # built once, kept for every layer


@pytest.mark.parametrize("seed", range(5))
def test_padded_groups_stay_within_the_waste_bound(seed):
    rng = random.Random(seed)
    works = [SeqWork(0, q, q + rng.randrange(0, 300), []) for q in (rng.choice([1, 1, 5, 64, 200]) for _ in range(20))]
    groups = group_by_padding(works)
    assert sorted(map(id, itertools.chain(*groups))) == sorted(map(id, works))
    for group in groups:
        assert len(group) == 1 or _padded_area(group) <= (1 + MAX_PADDING_WASTE) * _real_area(group)


def test_every_layer_reads_in_place_with_the_same_plan():
    cache = make_cache()
    cache.layers.append(torch.randn_like(cache.layers[0]))
    tables = [list(range(100, 250)), list(range(300, 600, 2)), list(range(600, 630)) + list(range(640, 880, 2))]
    meta = step_meta(cache, [1, 1, 1], [600, 597, 591], tables)
    query, key = torch.randn(3, NUM_HEADS, HEAD_DIM), torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    meta.backend.prepare(meta)
    for layer_idx in (0, 1):
        out = meta.backend.forward(layer_idx, query, key, key, meta, SCALE)
        cache.layers[0], cache.layers[layer_idx] = cache.layers[layer_idx], cache.layers[0]  # the reference reads layer 0
        torch.testing.assert_close(out.double(), dense_reference(cache, meta, query), atol=1e-5, rtol=1e-5)
        cache.layers[0], cache.layers[layer_idx] = cache.layers[layer_idx], cache.layers[0]
    assert len(meta.backend_state.plan.in_place.patterns) == 1


def test_a_cache_the_sparse_products_cannot_read_is_attended_padded():
    layout = KVLayout("test", 1, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, "bfloat16")
    cache = KVCache(layout, NUM_BLOCKS, torch.device("cpu"))
    cache.layers[0].normal_(generator=torch.Generator().manual_seed(1))
    meta = step_meta(cache, [1, 1], [40, 9], [list(range(10)), [20, 30, 40]])
    meta.backend.prepare(meta)
    assert meta.backend_state.plan.in_place is None and len(meta.backend_state.plan.groups) >= 1
    query, key = torch.randn(2, NUM_HEADS, HEAD_DIM), torch.randn(2, NUM_KV_HEADS, HEAD_DIM)
    out = meta.backend.forward(0, query, key, key, meta, SCALE)
    torch.testing.assert_close(out.double(), dense_reference(cache, meta, query), atol=3e-2, rtol=3e-2)


def test_gather_blocks_equals_indexing_the_cache():
    from workers.engine.paged_attention import gather_blocks

    cache = torch.randn(2, 40, 16, 2, 8)
    table = torch.randint(0, 40, (5, 7))
    assert torch.equal(gather_blocks(cache, table), cache[:, table])
    ids = torch.tensor([3, 3, 0, 39])
    assert torch.equal(gather_blocks(cache, ids), cache[:, ids])
