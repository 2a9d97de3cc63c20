"""Logprobs of generated tokens: log_softmax of the model's raw logits, equal to
transformers' own within 1e-4 (fp32, CPU), batched with other requests, and the same after
a KV import through a real transport (the prefill replica's first-token logprob travels in
the DONE header)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine_support import make_engine_fixture, random_prompts  # noqa: F401
from tests.test_transport_backends import KEY, config
from transport.base import TransferCorrupt
from transport.factory import make_receiver, make_sender
from transport.wire import DONE, Header, WireCodec, done_header, first_token
from workers.engine import SamplingParams
from workers.engine.sequence import TokenLogprob

TOL = 1e-4
PROMPTS = random_prompts([5, 17, 33], seed=3)


@pytest.fixture(scope="module", name="hf_model")
def hf_model_fixture(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """transformers' log_softmax at each position that produced one of `output`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    return logits[len(prompt) - 1:-1].log_softmax(dim=-1)


def run(engine, requests: dict[str, tuple[list[int], SamplingParams, int]]) -> dict[str, tuple]:
    """Add every request, step until idle; per request: (output ids, logprobs of every report)."""
    for rid, (prompt, params, seed) in requests.items():
        engine.add_request(rid, prompt, params, seed=seed)
    return collect(engine, requests)


def collect(engine, request_ids) -> dict[str, tuple]:
    token_ids = {rid: [] for rid in request_ids}
    logprobs = {rid: [] for rid in request_ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_ids[out.request_id] += out.new_token_ids
            if out.logprobs is not None:
                assert len(out.logprobs) == len(out.new_token_ids)
                logprobs[out.request_id] += out.logprobs
    return {rid: (token_ids[rid], logprobs[rid]) for rid in request_ids}


def run_disagg(prefill, decode, backend: str, requests, neighbours=None) -> dict[str, tuple]:
    """Prefill `requests` together on `prefill`, stream their KV through `backend` into
    `decode`, commit each with the first token (and logprob) the receiver got, and decode
    them beside `neighbours` (plain local requests on `decode`)."""
    receiver = make_receiver(config(backend), decode, KEY)
    sender = make_sender(config(backend), KEY)
    try:
        reservations, sinks = {}, {}
        for rid, (prompt, params, seed) in requests.items():
            reservations[rid] = res = decode.reserve_kv(f"t-{rid}", prompt)
            receiver.expect(res.transfer_id, res, timeout=60)
            sinks[rid] = sink = sender.open(res.transfer_id, receiver.address, prefill.layout,
                                            start_block=res.num_cached_blocks)
            prefill.add_request(rid, prompt, params, kv_sink=sink, seed=seed)
        while prefill.has_unfinished_requests():
            prefill.step()
        for rid, (prompt, params, seed) in (neighbours or {}).items():
            decode.add_request(rid, prompt, params, seed=seed)
        for rid, (_, params, seed) in requests.items():
            first = receiver.wait(reservations[rid].transfer_id, 60)
            sinks[rid].wait(60)
            decode.commit_kv(reservations[rid], rid, params, first.token_id, seed=seed,
                             first_logprob=first.logprob)
        return collect(decode, [*requests, *(neighbours or {})])
    finally:
        sender.close()
        receiver.close()


def assert_matches_hf(model, prompt, token_ids, logprobs, num_top: int) -> None:
    want = hf_logprobs(model, prompt, token_ids)
    assert [lp.token_id for lp in logprobs] == token_ids
    for pos, lp in enumerate(logprobs):
        assert abs(lp.logprob - want[pos, lp.token_id].item()) < TOL, pos
        assert len(lp.top) == num_top
        top_lp, top_ids = want[pos].topk(num_top) if num_top else (torch.empty(0), torch.empty(0))
        assert [t for t, _ in lp.top] == top_ids.tolist(), pos
        assert all(abs(a - b) < TOL for (_, a), b in zip(lp.top, top_lp.tolist(), strict=True))


def mixed_requests(num_top: int) -> dict[str, tuple[list[int], SamplingParams, int]]:
    """Greedy and sampled requests that ask for logprobs, and one that does not."""
    return {
        "greedy": (PROMPTS[0], SamplingParams(max_tokens=6, temperature=0.0, logprobs=num_top, ignore_eos=True), 0),
        "sampled": (PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.9, top_k=40, logprobs=num_top,
                                               ignore_eos=True), 11),
        "penalised": (PROMPTS[2], SamplingParams(max_tokens=6, temperature=0.0, logprobs=num_top, ignore_eos=True,
                                                 repetition_penalty=1.3, logit_bias=((65, 2.0),)), 0),
    }


NEIGHBOUR = {"plain": (random_prompts([9], seed=8)[0], SamplingParams(max_tokens=8, temperature=0.0,
                                                                       ignore_eos=True), 0)}


@pytest.mark.parametrize("num_top", [0, 5])
def test_logprobs_equal_transformers_log_softmax_in_a_batch(make_engine, hf_model, num_top):
    requests = mixed_requests(num_top)
    got = run(make_engine(), {**requests, **NEIGHBOUR})
    for rid, (prompt, _, _) in requests.items():
        assert_matches_hf(hf_model, prompt, *got[rid], num_top)
    assert got["plain"][1] == []  # a request that did not ask reports none


@pytest.mark.parametrize("backend", ["local", "zmq"])
@pytest.mark.parametrize("num_top", [0, 5])
def test_logprobs_after_an_import_equal_a_local_run(make_engine, hf_model, backend, num_top):
    requests = mixed_requests(num_top)
    local = run(make_engine(), requests)
    remote = run_disagg(make_engine(), make_engine(), backend, requests, NEIGHBOUR)
    for rid, (prompt, _, _) in requests.items():
        assert_same(remote[rid], local[rid])
        assert remote[rid][1][0] == local[rid][1][0]  # the prefill engine's, carried exactly
        assert_matches_hf(hf_model, prompt, *remote[rid], num_top)


def assert_same(got, want) -> None:
    """Same tokens and alternatives; logprobs equal up to the last bits a different batch
    can change (the first token's, sampled by the prefill engine, travels exactly)."""
    (got_ids, got_lps), (want_ids, want_lps) = got, want
    assert got_ids == want_ids
    assert [[t for t, _ in lp.top] for lp in got_lps] == [[t for t, _ in lp.top] for lp in want_lps]
    values = lambda lps: torch.tensor([[lp.logprob, *(v for _, v in lp.top)] for lp in lps])  # noqa: E731
    if want_lps:
        torch.testing.assert_close(values(got_lps), values(want_lps), rtol=0, atol=1e-5)


def test_done_header_carries_the_first_logprob_through_the_seal():
    codec = WireCodec(b"k" * 32)
    top = tuple((i, -0.5 - i) for i in range(20))
    logprob = TokenLogprob(0, -0.5, top)
    opened = codec.open(*codec.seal(done_header("t", 3, 0, logprob)))
    assert first_token(opened).logprob == logprob and first_token(opened).token_id == 0
    plain = codec.open(*codec.seal(done_header("t", 3, 7, None)))
    assert first_token(plain).token_id == 7 and first_token(plain).logprob is None


@pytest.mark.parametrize("fields", [
    {"first_logprob": -1.0, "first_top_ids": list(range(21)), "first_top_logprobs": [-1.0] * 21},
    {"first_logprob": -1.0, "first_top_ids": [1, 2], "first_top_logprobs": [-1.0]},
    {"first_logprob": None, "first_top_ids": [1], "first_top_logprobs": [-1.0]},
    {"first_logprob": -1.0, "first_top_ids": [-1], "first_top_logprobs": [-1.0]},
])
def test_done_header_refuses_malformed_logprobs(fields):
    codec = WireCodec(b"k" * 32)
    with pytest.raises(TransferCorrupt):
        codec.open(*codec.seal(Header(DONE, "t", 1, first_token_id=3, **fields)))


def test_every_sequence_of_n_reports_its_own_logprobs(make_engine, hf_model):
    """Forked sequences sample their first token from the parent's logits: each still
    reports one logprob per token, equal to transformers' on its own output."""
    engine = make_engine()
    params = SamplingParams(max_tokens=5, temperature=1.0, n=3, logprobs=2, ignore_eos=True)
    engine.add_request("n3", PROMPTS[1], params, seed=5)
    token_ids, logprobs = {}, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            token_ids.setdefault(out.index, []).extend(out.new_token_ids)
            logprobs.setdefault(out.index, []).extend(out.logprobs)
    assert sorted(token_ids) == [0, 1, 2]
    for index, ids in token_ids.items():
        assert_matches_hf(hf_model, PROMPTS[1], ids, logprobs[index], 2)
