"""n > 1 and best_of: one prefill, forked sequences sharing the prompt's blocks (a copy of
the partial last one), each exactly the run a single request with seed + i makes; the
block pool stays consistent through aborts and preemptions."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_support import make_engine_fixture, random_prompts  # noqa: F401
from tests.test_transport_backends import KEY, config
from transport.base import TransferCorrupt
from transport.factory import make_receiver, make_sender
from transport.wire import DONE, Header, WireCodec, done_header, first_token
from workers.async_engine import AsyncEngine
from workers.engine import LLMEngine, SamplingParams
from workers.engine.kv_types import FirstToken
from workers.engine.sequence import TokenLogprob

SEED = 1234


def sampled(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 12, "temperature": 0.9, "top_k": 40, "ignore_eos": True,
                             "seed": SEED, **kw})


def separate_runs(make_engine, prompt: list[int], params: SamplingParams, num: int) -> list[list[int]]:
    engine = make_engine()
    return [engine.generate([prompt], SamplingParams(**{**params.__dict__, "n": 1, "best_of": None,
                                                        "seed": SEED + i}))[0].token_ids
            for i in range(num)]


def run_checked(engine, request_id: str, prompt: list[int], params: SamplingParams) -> dict:
    """Step to the end, checking integrity after every step; final outputs by index."""
    engine.add_request(request_id, prompt, params)
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.index not in final
                final[out.index] = out
        engine.check_integrity()
    return final


@pytest.mark.parametrize("prompt_len", [20, 32, 5])
def test_n3_prefills_once_and_each_sequence_is_its_seed(make_engine, prompt_len):
    prompt = random_prompts([prompt_len], seed=prompt_len)[0]
    params = sampled(n=3)
    engine = make_engine()
    final = run_checked(engine, "r", prompt, params)
    assert sorted(final) == [0, 1, 2]
    assert engine.stats()["num_prompt_tokens_computed"] == prompt_len
    want = separate_runs(make_engine, prompt, params, 3)
    assert [final[i].token_ids for i in range(3)] == want
    assert len({tuple(w) for w in want}) == 3  # they really differ
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_children_share_full_prompt_blocks_and_copy_the_partial_one(make_engine):
    engine = make_engine()
    prompt = random_prompts([40], seed=3)[0]  # two full blocks + 8 tokens
    engine.add_request("r", prompt, sampled(n=3, max_tokens=4))
    while len(engine._sequences_of("r")) < 3:
        engine.step()
    seqs = sorted(engine._sequences_of("r"), key=lambda s: s.index)
    full = [s.block_ids[:2] for s in seqs]
    assert full[0] == full[1] == full[2]
    assert all(engine.block_manager.blocks[b].ref_count == 3 for b in full[0])
    assert len({s.block_ids[2] for s in seqs}) == 3
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()


def test_generate_returns_n_outputs_per_prompt_and_n1_is_unchanged(make_engine):
    engine = make_engine()
    prompts = random_prompts([9, 18], seed=5)
    outs = engine.generate(prompts, [sampled(n=2), sampled()])
    assert [(o.request_id == outs[0].request_id, o.index) for o in outs] == [(True, 0), (True, 1), (False, 0)]
    assert outs[2].token_ids == make_engine().generate([prompts[1]], sampled())[0].token_ids


def test_best_of_returns_the_most_likely_and_streams_nothing_before(make_engine, tiny_model_dir):
    prompt = random_prompts([15], seed=8)[0]
    params = sampled(n=1, best_of=3, max_tokens=6)
    engine = make_engine()
    engine.add_request("r", prompt, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert len(outs) == 1 and outs[0].finished and outs[0].index == 0
    candidates = separate_runs(make_engine, prompt, params, 3)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    scores = [cumulative_logprob(model, prompt, c) for c in candidates]
    assert outs[0].token_ids == candidates[max(range(3), key=scores.__getitem__)]
    assert outs[0].new_token_ids == outs[0].token_ids


def cumulative_logprob(model, prompt: list[int], generated: list[int]) -> float:
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt + generated])).logits[0].float().log_softmax(-1)
    return sum(logprobs[len(prompt) - 1 + j, t].item() for j, t in enumerate(generated))


def test_best_of_n2_returns_two_reindexed(make_engine):
    engine = make_engine()
    outs = engine.generate([random_prompts([12], seed=2)[0]], sampled(n=2, best_of=4, max_tokens=5))
    assert [o.index for o in outs] == [0, 1] and all(len(o.token_ids) == 5 for o in outs)


def test_abort_of_a_forked_request_frees_everything(make_engine):
    engine = make_engine()
    engine.add_request("r", random_prompts([30], seed=4)[0], sampled(n=3, max_tokens=50))
    while len(engine._sequences_of("r")) < 3:
        engine.step()
    engine.step()
    assert engine.abort_request("r")
    engine.check_integrity()
    aborted = engine.step()
    assert sorted(o.index for o in aborted) == [0, 1, 2] and all(o.finish_reason == "abort" for o in aborted)
    assert not engine.has_unfinished_requests()
    assert engine.stats()["kv_blocks_free"] == engine.stats()["kv_blocks_total"]


def test_preempting_a_child_recomputes_it_exactly(make_engine):
    prompt = random_prompts([40], seed=6)[0]
    params = sampled(n=3, max_tokens=40)
    engine = make_engine(num_kv_blocks=8)
    final = run_checked(engine, "r", prompt, params)
    assert engine.stats()["num_preemptions"] > 0
    assert [final[i].token_ids for i in range(3)] == separate_runs(make_engine, prompt, params, 3)


def test_async_engine_streams_each_sequence_by_index_until_all_end(make_engine, tiny_model_dir):
    prompt = random_prompts([21], seed=9)[0]
    params = sampled(n=3, max_tokens=7)
    want = separate_runs(make_engine, prompt, params, 3)
    best = make_engine().generate([prompt], sampled(n=1, best_of=3, max_tokens=7))[0].token_ids
    aengine = AsyncEngine(LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=64))

    async def collect(request_id, p):
        got: dict[int, list[int]] = {}
        finished = []
        async for chunk in aengine.generate(request_id, prompt, p, seed=SEED):
            got.setdefault(chunk.index, []).extend(chunk.token_ids)
            finished += [chunk.index] * chunk.finished
        return got, finished

    try:
        got, finished = asyncio.run(collect("r#0", params))
        assert sorted(finished) == [0, 1, 2] and [got[i] for i in range(3)] == want
        got, finished = asyncio.run(collect("b#0", sampled(n=1, best_of=3, max_tokens=7)))
        assert finished == [0] and got[0] == best
        asyncio.run(aengine.check_integrity())
    finally:
        aengine.shutdown()


@dataclasses.dataclass
class Handover:
    prefill_outputs: list
    first: object  # the receiver's FirstToken
    final: list  # the decode engine's finished outputs, in order
    prefill: object
    decode: object


def disaggregate(make_engine, backend: str, prompt: list[int], params: SamplingParams) -> Handover:
    """One request prefilled on one engine (which samples its first tokens) and decoded on
    another after a real transfer; the decode engine's integrity is checked every step."""
    prefill, decode = make_engine(), make_engine()
    receiver = make_receiver(config(backend), decode, KEY)
    sender = make_sender(config(backend), KEY)
    try:
        res = decode.reserve_kv("t", prompt)
        receiver.expect("t", res, timeout=60)
        sink = sender.open("t", receiver.address, prefill.layout, start_block=res.num_cached_blocks)
        prefill.add_request("p", prompt, dataclasses.replace(params, max_tokens=1), kv_sink=sink, seed=SEED)
        prefill_outputs = []
        while prefill.has_unfinished_requests():
            prefill_outputs += prefill.step()
        first = receiver.wait("t", 60)
        sink.wait(60)
        decode.commit_kv(res, "d", params, first.token_id, seed=SEED, first_logprob=first.logprob,
                         siblings=first.siblings)
        final = []
        while decode.has_unfinished_requests():
            final += [o for o in decode.step() if o.finished]
            decode.check_integrity()
    finally:
        sender.close()
        receiver.close()
    return Handover(prefill_outputs, first, final, prefill, decode)


@pytest.mark.parametrize("backend", ["local", "zmq"])
def test_disaggregated_n3_samples_first_tokens_on_prefill_and_forks_on_decode(make_engine, backend):
    """The prefill engine samples all three first tokens (seeds seed + i) and sends them
    with the last layer; the decode engine forks the request: the same three sequences as
    a local run, the prompt computed once (on the prefill engine)."""
    prompt = random_prompts([37], seed=11)[0]
    params = sampled(n=3, max_tokens=8, logprobs=2)
    local = make_engine().generate([prompt], params)
    run = disaggregate(make_engine, backend, prompt, params)
    assert [o.index for o in run.prefill_outputs] == [0]  # the prefill engine does not fork
    first = run.first
    assert [first.token_id, *(s.token_id for s in first.siblings)] == [o.token_ids[0] for o in local]
    assert [s.logprob.top for s in first.siblings] == [first.logprob.top] * 2
    final = {o.index: o for o in run.final}
    assert [final[i].token_ids for i in range(3)] == [o.token_ids for o in local]
    assert run.prefill.stats()["num_prompt_tokens_computed"] == len(prompt)
    assert run.decode.stats()["num_prompt_tokens_computed"] == 0


@pytest.mark.parametrize("backend", ["local", "zmq"])
def test_disaggregated_best_of_ranks_with_first_token_scores_from_prefill(make_engine, backend):
    """best_of > n without logprobs: the prefill engine still sends each first token's raw
    logprob (the start of its score), so the decode engine returns the same best sequence
    as a local run, and the prefill engine finishes its one-token request."""
    params = sampled(n=1, best_of=3, max_tokens=6)
    prompt = _prompt_where_the_first_token_decides(make_engine(), params)
    local = make_engine().generate([prompt], params)
    run = disaggregate(make_engine, backend, prompt, params)
    assert [o.finished for o in run.prefill_outputs] == [True]
    assert run.first.logprob is not None and all(s.logprob is not None for s in run.first.siblings)
    assert [(o.index, o.token_ids, o.logprobs) for o in run.final] == [(0, local[0].token_ids, None)]


def _prompt_where_the_first_token_decides(engine, params: SamplingParams) -> list[int]:
    """A prompt whose best sequence changes when the first token's logprob is left out of
    the score, so a test of the handover cannot pass without it."""
    for seed in range(64):
        prompt = random_prompts([23], seed=seed)[0]
        outs = engine.generate([prompt], dataclasses.replace(params, n=3, best_of=None, logprobs=0))
        full = [sum(lp.logprob for lp in o.logprobs) for o in outs]
        rest = [sum(lp.logprob for lp in o.logprobs[1:]) for o in outs]
        if max(range(3), key=full.__getitem__) != max(range(3), key=rest.__getitem__):
            return prompt
    raise AssertionError("no prompt where the first token decides the ranking")


def test_done_header_carries_sibling_first_tokens():
    codec = WireCodec(b"k" * 32)
    top = ((4, -0.25), (9, -1.5))
    siblings = (FirstToken(9, TokenLogprob(9, -1.5, top)), FirstToken(4, TokenLogprob(4, -0.25, top)))
    opened = first_token(codec.open(*codec.seal(done_header("t", 1, 4, TokenLogprob(4, -0.25, top), siblings))))
    assert opened.siblings == siblings
    plain = first_token(codec.open(*codec.seal(done_header("t", 1, 4, None, (FirstToken(7),)))))
    assert plain.siblings == (FirstToken(7),) and plain.logprob is None
    with pytest.raises(TransferCorrupt):
        codec.open(*codec.seal(Header(DONE, "t", 1, first_token_id=3, sibling_token_ids=[-1])))


def test_a_forking_request_is_admitted_with_a_seat_for_every_sequence(make_engine):
    """max_num_seqs counts sequences: a request of n = 3 takes 3 of 4 seats from its
    admission, so a later request waits and the forks never queue behind it."""
    engine = make_engine(max_num_seqs=4)
    prompts = random_prompts([20, 20, 20], seed=1)
    plain = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    engine.add_request("a", prompts[0], dataclasses.replace(plain, n=3))
    engine.add_request("b", prompts[1], plain)
    engine.add_request("c", prompts[2], plain)
    engine.step()
    assert sorted(s.seq_id for s in engine.scheduler.waiting) == ["a\x001", "a\x002", "c"]
    engine.step()
    assert sorted(s.seq_id for s in engine.scheduler.running) == ["a", "a\x001", "a\x002", "b"]
    while engine.has_unfinished_requests():
        engine.step()
        assert len(engine.scheduler.running) <= 4
        engine.check_integrity()
