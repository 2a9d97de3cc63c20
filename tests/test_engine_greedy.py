"""Greedy output equals transformers' `generate(do_sample=False)` token for token, for one
concurrent batch of prompts around block boundaries, under every scheduling regime:
plain, chunked prefill, prefix caching on and off, and a pool small enough to preempt."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_support import (  # noqa: F401
    MAX_TOKENS,
    PROMPT_LENS,
    greedy,
    hf_greedy,
    make_engine_fixture,
    random_prompts,
)

PROMPTS = random_prompts(PROMPT_LENS)
# A shared 40-token "system prompt" (2.5 blocks) in front of varied questions.
SHARED = random_prompts([40], seed=1)[0]
SHARED_PROMPTS = [SHARED + q for q in random_prompts([1, 7, 16, 25, 40, 3], seed=2)] + [SHARED[:33], SHARED]


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(hf_model):
    return [hf_greedy(hf_model, p, n) for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]


@pytest.fixture(scope="module")
def shared_reference(hf_model):
    return [hf_greedy(hf_model, p, 12) for p in SHARED_PROMPTS]


def run(engine, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    outs = engine.generate(prompts, [greedy(n) for n in max_tokens])
    for out, n in zip(outs, max_tokens, strict=True):
        assert out.finished and out.finish_reason in ("stop", "length")
        assert (out.finish_reason == "length") == (len(out.token_ids) == n)
    return [o.token_ids for o in outs]


def test_one_concurrent_batch_matches_transformers(make_engine, reference):
    assert len(PROMPTS) >= 16
    engine = make_engine(max_num_batched_tokens=2048)
    assert run(engine) == reference
    assert engine.stats()["num_preemptions"] == 0


def test_chunked_prefill_matches_transformers(make_engine, reference):
    engine = make_engine(max_num_batched_tokens=23, max_num_seqs=5)
    assert run(engine) == reference
    records = list(engine.step_records)
    assert max(r.num_prefill_tokens + r.num_decode_seqs for r in records) <= 23
    assert any(r.num_prefill_tokens and r.num_decode_seqs for r in records), "no step mixed prefill and decode"


def test_preemption_under_a_tiny_pool_matches_transformers(make_engine, reference):
    # The longest request needs 34 blocks; 40 cannot hold the batch, so sequences are
    # preempted and recomputed (their prefix mostly from the cache).
    engine = make_engine(num_kv_blocks=40, max_num_batched_tokens=256)
    assert run(engine) == reference
    assert engine.stats()["num_preemptions"] > 0
    assert engine.stats()["kv_blocks_free"] == 40


def test_prefix_caching_on_and_off_agree_and_hits_are_counted(make_engine, shared_reference):
    max_tokens = [12] * len(SHARED_PROMPTS)
    off = make_engine(enable_prefix_caching=False)
    assert run(off, SHARED_PROMPTS, max_tokens) == shared_reference
    assert off.stats()["prefix_cache_hits"] == 0

    on = make_engine(enable_prefix_caching=True, max_num_seqs=2)  # later requests find the prefix cached
    assert run(on, SHARED_PROMPTS, max_tokens) == shared_reference
    stats = on.stats()
    assert stats["prefix_cache_queries"] == sum(len(p) for p in SHARED_PROMPTS)
    assert stats["prefix_cache_hits"] >= 2 * 16 * (len(SHARED_PROMPTS) - 2)
    # A second round hits whole prompts (capped so the last token is recomputed).
    before = stats["prefix_cache_hits"]
    assert run(on, SHARED_PROMPTS, max_tokens) == shared_reference
    assert on.stats()["prefix_cache_hits"] - before >= sum((len(p) - 1) // 16 * 16 for p in SHARED_PROMPTS)


def test_repeated_prompt_hits_its_own_cache_with_block_size_4(make_engine, hf_model):
    prompt = PROMPTS[12]  # 100 tokens = 25 blocks of 4: a hit must stop before the last token
    expected = hf_greedy(hf_model, prompt, 10)
    engine = make_engine(block_size=4, num_kv_blocks=200)
    for _ in range(2):
        assert engine.generate([prompt], greedy(10))[0].token_ids == expected
    assert engine.stats()["prefix_cache_hits"] == 96
