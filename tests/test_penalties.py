"""Penalties and logit bias: the engine's greedy output is exactly what a plain-Python
reference of OpenAI's formula (and HF's repetition penalty) predicts from transformers'
logits, step by step; a bias of +100 forces a token and -100 bans it; and both routes
(local, and a KV import through a real transport) give the same tokens and logprobs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.engine_support import make_engine_fixture, random_prompts  # noqa: F401
from tests.test_logprobs import NEIGHBOUR, assert_same, hf_model_fixture, run, run_disagg  # noqa: F401
from workers.engine import SamplingParams
from workers.engine.penalties import apply_logit_bias, apply_penalties
from workers.engine.sampler import SamplingRow

PROMPTS = random_prompts([6, 20, 37], seed=5)
PENALISED = [  # request i runs PROMPTS[i % 3]; each changes its prompt's plain greedy output
    dict(presence_penalty=2.0, frequency_penalty=-0.3),
    dict(repetition_penalty=1.8),
    dict(frequency_penalty=0.8),
    dict(repetition_penalty=0.7, presence_penalty=0.5, logit_bias=((70, 1.5), (66, -3.0))),
]


def reference(logits: list[float], prompt: list[int], output: list[int], params: SamplingParams) -> list[float]:
    """The documented formulas, one token at a time: bias, HF's repetition penalty over the
    prompt and output, then OpenAI's frequency and presence penalties over the output."""
    out = list(logits)
    for t, bias in params.logit_bias:
        out[t] += bias
    p = params.repetition_penalty
    for t in set(prompt) | set(output):
        out[t] = out[t] / p if out[t] > 0 else out[t] * p
    for t, count in Counter(output).items():
        out[t] -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
    return out


def reference_greedy(model, prompt: list[int], params: SamplingParams) -> list[int]:
    output: list[int] = []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float().tolist()
        scores = reference(logits, prompt, output, params)
        output.append(max(range(len(scores)), key=scores.__getitem__))
    return output


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_penalised_greedy_output_is_the_reference_formulas_step_by_step(make_engine, hf_model):
    requests = {f"r{i}": (PROMPTS[i % len(PROMPTS)], greedy(**kw), 0) for i, kw in enumerate(PENALISED)}
    got = run(make_engine(), {**requests, **NEIGHBOUR})  # batched, beside a request with none
    plain = run(make_engine(), {rid: (prompt, greedy(), 0) for rid, (prompt, _, _) in requests.items()})
    for rid, (prompt, params, _) in requests.items():
        assert got[rid][0] == reference_greedy(hf_model, prompt, params), rid
        assert got[rid][0] != plain[rid][0], f"{rid}: the penalty changed nothing, the test proves nothing"


def test_logit_bias_of_100_forces_a_token_and_minus_100_bans_it(make_engine):
    engine = make_engine()
    plain = run(engine, {"plain": (PROMPTS[1], greedy(), 0)})["plain"][0]
    banned = tuple((t, -100.0) for t in set(plain))
    got = run(engine, {
        "forced": (PROMPTS[1], greedy(logit_bias=((42, 100.0),)), 0),
        "forced-sampled": (PROMPTS[1], SamplingParams(max_tokens=16, temperature=1.0, logit_bias=((42, 100.0),),
                                                      ignore_eos=True), 3),
        "banned": (PROMPTS[1], greedy(logit_bias=banned), 0),
    })
    assert got["forced"][0] == [42] * 16 and got["forced-sampled"][0] == [42] * 16
    assert not set(got["banned"][0]) & set(plain)


@pytest.mark.parametrize("backend", ["local", "zmq"])
def test_penalties_give_the_same_tokens_and_logprobs_on_both_routes(make_engine, backend):
    """The decode side derives the penalties' state from the prompt and the first token it
    commits: nothing but the token (and its logprob) crosses."""
    requests = {
        "greedy": (PROMPTS[0], greedy(16, logprobs=3, frequency_penalty=0.6, presence_penalty=0.4,
                                      repetition_penalty=1.2), 0),
        "sampled": (PROMPTS[2], SamplingParams(max_tokens=16, temperature=0.8, logprobs=3, ignore_eos=True,
                                               frequency_penalty=1.0, repetition_penalty=1.3,
                                               logit_bias=((65, 2.0),)), 1234),
    }
    local = run(make_engine(), requests)
    remote = run_disagg(make_engine(), make_engine(), backend, requests, NEIGHBOUR)
    for rid in requests:
        assert_same(remote[rid], local[rid])


def _row(params: SamplingParams, prompt=(), output=()) -> SamplingRow:
    return SamplingRow(params, 0, len(output), frozenset(), tuple(prompt), tuple(output))


def test_batched_penalties_equal_the_reference_per_row_and_skip_rows_without():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen) * 3
    rows = [_row(SamplingParams(), [1, 2], [3]),
            _row(SamplingParams(frequency_penalty=0.5, presence_penalty=0.2), [1, 2, 2], [3, 3, 4, 60]),
            _row(SamplingParams(repetition_penalty=1.5, logit_bias=((7, 4.0), (99, 1.0))), [5, 6], [7, 5]),
            _row(SamplingParams(logit_bias=((0, -100.0),)), [9], []),
            _row(SamplingParams(repetition_penalty=0.5, frequency_penalty=-1.0), [], [8, 8, 8])]
    got = apply_penalties(apply_logit_bias(logits, rows), rows)
    for i, row in enumerate(rows):
        want = reference(logits[i].tolist(), [t for t in row.prompt_token_ids if t < 50],
                         [t for t in row.output_token_ids if t < 50],
                         SamplingParams(**{**row.params.__dict__,
                                           "logit_bias": [(t, b) for t, b in row.params.logit_bias if t < 50]}))
        torch.testing.assert_close(got[i], torch.tensor(want), rtol=0, atol=1e-5)
    assert torch.equal(got[0], logits[0])
    plain = [_row(SamplingParams(), [1], [2])] * 5
    assert apply_penalties(apply_logit_bias(logits, plain), plain) is logits  # nothing asked, nothing done
