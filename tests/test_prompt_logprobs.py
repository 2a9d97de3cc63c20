"""Prompt logprobs equal transformers' log-softmax at every prompt position (fp32), however
the prompt was computed: in one step or chunks, after a prefix-cache hit, after a
preemption, or on another engine whose KV was imported."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from tests.test_engine_kv_transfer import CollectingSink, finish, import_kv
from workers.async_engine import AsyncEngine
from workers.engine import LLMEngine, SamplingParams
from workers.engine.sequence import TokenLogprob
from workers.protocol import PrefillResult
from workers.stream.wire import StreamCodec, prefill_result_from_wire, to_wire

K = 3


class Sink(CollectingSink):
    def on_complete(self, first_token_id, *more) -> None:  # whatever else rides with the token
        super().on_complete(first_token_id)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference(model, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def check(entries, model, prompt: list[int]) -> None:
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    ref = reference(model, prompt)
    for j in range(1, len(prompt)):
        e, row = entries[j], ref[j - 1]
        assert e.token_id == prompt[j]
        assert abs(e.logprob - row[prompt[j]].item()) < 1e-4, j
        top_lps, top_ids = row.topk(K)
        assert len(e.top) == K
        assert [lp for _, lp in e.top] == pytest.approx(top_lps.tolist(), abs=1e-4)
        assert {i for i, _ in e.top} == set(top_ids.tolist()) or len(set(top_lps.tolist())) < K


def first_output(engine, request_id: str):
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id and out.new_token_ids:
                return out
    raise AssertionError("no output")


def run(engine, request_id: str, prompt: list[int], params: SamplingParams):
    engine.add_request(request_id, prompt, params)
    first = first_output(engine, request_id)
    finish(engine, request_id)
    return first


def test_one_step_and_chunked_prefill_match_transformers(make_engine, hf_model):
    params = greedy(2, prompt_logprobs=K)
    for lens, budget in (([1, 17, 40], 1024), ([70], 16), ([33], 5)):
        engine = make_engine(max_num_batched_tokens=budget)
        for i, prompt in enumerate(random_prompts(lens, seed=budget)):
            check(run(engine, f"r{i}", prompt, params).prompt_logprobs, hf_model, prompt)


def test_only_the_first_output_carries_them_and_others_pay_nothing(make_engine):
    engine = make_engine()
    prompt = random_prompts([20])[0]
    engine.add_request("a", prompt, greedy(4, ignore_eos=True, prompt_logprobs=0))
    engine.add_request("b", prompt, greedy(4, ignore_eos=True))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    a = [o.prompt_logprobs for o in outs if o.request_id == "a"]
    assert len(a[0]) == 20 and all(e.top == () for e in a[0][1:]) and a[1:] == [None] * 3
    assert all(o.prompt_logprobs is None for o in outs if o.request_id == "b")


def test_a_prefix_cache_hit_is_recomputed_not_missing(make_engine, hf_model):
    engine = make_engine()
    prompt = random_prompts([50], seed=2)[0]
    engine.generate([prompt], greedy(1))  # caches 3 blocks
    before = engine.stats()["num_prompt_tokens_computed"]
    out = run(engine, "r", prompt, greedy(1, prompt_logprobs=K))
    check(out.prompt_logprobs, hf_model, prompt)
    assert out.num_cached_tokens == 0
    assert engine.stats()["num_prompt_tokens_computed"] - before == 50
    # its blocks still register: a plain request after it hits the cache
    assert engine.generate([prompt], greedy(1))[0].num_cached_tokens == 48


def test_preemption_neither_duplicates_nor_loses_entries(make_engine, hf_model):
    engine = make_engine(num_kv_blocks=8, max_num_batched_tokens=16)
    prompts = random_prompts([60, 60], seed=4)
    engine.add_request("a", prompts[0], greedy(30, ignore_eos=True, prompt_logprobs=K))
    engine.add_request("b", prompts[1], greedy(30, ignore_eos=True, priority=1, prompt_logprobs=K))
    firsts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.prompt_logprobs is not None:
                assert out.request_id not in firsts
                firsts[out.request_id] = out.prompt_logprobs
    assert engine.stats()["num_preemptions"] > 0
    for request_id, prompt in zip("ab", prompts, strict=True):
        check(firsts[request_id], hf_model, prompt)


def test_remote_prefill_computes_them_and_the_decode_engine_reports_them(make_engine, hf_model):
    prompt = random_prompts([45], seed=5)[0]
    params = greedy(6, ignore_eos=True, prompt_logprobs=K)
    prefill, decode = make_engine(max_num_batched_tokens=16), make_engine()
    prefill.add_request("warm", prompt, greedy(1))  # a cached prefix on the prefill side too
    finish(prefill, "warm")
    sink = Sink()
    prefill.add_request("p", prompt, dataclasses.replace(params, max_tokens=1), kv_sink=sink, seed=0)
    computed = first_output(prefill, "p").prompt_logprobs
    check(computed, hf_model, prompt)
    reservation = import_kv(decode, "t", prompt, sink)
    decode.commit_kv(reservation, "d", params, sink.first_token_id, prompt_logprobs=computed)
    first = first_output(decode, "d")
    assert first.prompt_logprobs == computed
    assert first.token_ids == make_engine().generate([prompt], params)[0].token_ids[:1]


def test_prefill_result_carries_them_over_the_worker_stream():
    entries = [None, TokenLogprob(5, -1.25, ((5, -1.25), (9, -2.5))), TokenLogprob(7, -0.5, ())]
    codec = StreamCodec("k" * 32)
    raw = codec.open(codec.seal({"t": "chunk", "r": to_wire(PrefillResult(3, 100, 0.5, entries))}))["r"]
    assert prefill_result_from_wire(raw) == PrefillResult(3, 100, 0.5, entries)
    assert prefill_result_from_wire(to_wire(PrefillResult(0, 1, 0.1))).prompt_logprobs is None


def test_async_engines_hand_them_from_prefill_to_the_first_decode_chunk(tiny_model_dir, hf_model):
    """The path a disaggregated request takes: the prefill replica's stream reports them
    (the prefill call's reply), the decode replica's first chunk carries them."""
    from tests.test_async_engine import _DirectSink, collect

    prompt = random_prompts([37], seed=6)[0]
    params = greedy(5, ignore_eos=True, prompt_logprobs=K)
    prefill = AsyncEngine(LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=64,
                                    max_num_batched_tokens=16))
    decode = AsyncEngine(LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=64))

    async def main():
        res = await decode.reserve_kv("t1", prompt)
        sink = _DirectSink(decode, res)
        chunks = [c async for c in prefill.generate("p#0", prompt, dataclasses.replace(params, max_tokens=1),
                                                    seed=0, kv_sink=sink)]
        computed = chunks[0].prompt_logprobs
        check(computed, hf_model, prompt)
        stream = decode.generate_from_kv(res, "d#0", params, sink.first_token_id, 0, prompt_logprobs=computed)
        first = await anext(stream)
        assert first.prompt_logprobs == computed
        _, _, last = await collect(stream)
        assert last.finished and last.prompt_logprobs is None
        await decode.check_integrity()

    try:
        asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()
