"""The objective a background prefill's chunk is sized to on the decode replica: the
streams there still in reach judged against the decode step alone, as `auto` scores
them; the workload's objective where every stream is past reach; none only where even
that one is below the decode step. And its size: a step the streams, waiting through it
beside the prompts arriving there, see inside that objective."""

from __future__ import annotations

import math

import pytest

from cluster.config import SLO
from router import predict, replica_steps
from router.auto_policy import candidates, chunk_objective_s
from router.candidate import RequestShape
from tests.test_auto_policy import BUSY_STREAMS, COEFFS, ctx, replica
from workers.engine.cost_model import StepCoefficients

CPU = StepCoefficients(0.013, 5e-4, 1e-7, 2e-3, 2e-6)  # the bench's CPU replicas, fitted
SLO_86 = SLO(ttft_ms=5400, tpot_ms=86)


def _stretched(allowances: tuple[float, ...]) -> dict:
    """A decode replica whose recent gaps ran at 330 ms (its last steps carried full-budget
    prompt chunks), three streams decoding at a decode step of about 25 ms."""
    return dict(coefficients=CPU, num_streams=3, stream_context=3 * 1500, stream_tokens_left=12.0,
                stream_allowances=allowances, recent_gap_s=0.33, recent_decode_seqs=3.0)


def _chunk(context) -> int:
    return next(c for c in candidates(context) if c.kind == "background").chunk_tokens


def test_streams_past_the_recent_gap_but_not_the_decode_step_keep_their_objective():
    """Three streams with 86 ms a token left, beside a replica whose recent gaps ran at
    330 ms: judged against that gap every one was past reach, the chunk was sized to no
    objective and took the whole budget (509 of 512 tokens, 0.4-0.7 s a step), and the
    requests landing there decoded at 230-390 ms a token (bench cluster, load shift)."""
    context = ctx(prompt_len=1470, slo=SLO_86, decode=replica("d1", **_stretched((0.086, 0.086, 0.086))))
    assert chunk_objective_s(context) == 0.086
    assert 40 <= _chunk(context) <= 140  # a step of 0.9 x 86 ms, not the budget


def test_streams_past_reach_even_of_the_decode_step_leave_the_workloads_objective():
    """Every stream there already misses (no budget left): the requests arriving to decode
    there meanwhile come with the workload's whole objective, and the chunk keeps it."""
    context = ctx(prompt_len=1470, slo=SLO_86, decode=replica("d1", **_stretched((0.0, 0.0, 0.01))))
    assert chunk_objective_s(context) == 0.086
    assert _chunk(context) < 512 - 3


def test_a_stream_in_reach_sets_the_objective_as_before():
    context = ctx(prompt_len=1470, slo=SLO_86, decode=replica("d1", **_stretched((0.0, 0.2, 0.3))))
    assert chunk_objective_s(context) == 0.2  # the tightest in reach; the one at 0 is past it


def test_an_objective_below_the_decode_step_sizes_no_chunk():
    """Every stream past reach and this workload's objective below the decode step itself:
    nobody there can be kept inside it, so the chunk is the whole budget (the candidate is
    a foreground prefill by another name), not one token a step for the length of the
    prompt while an idle prefill pool waits."""
    below = SLO(ttft_ms=20_000, tpot_ms=10)
    context = ctx(prompt_len=1470, slo=below, decode=replica("d1", **_stretched((0.0, 0.0, 0.01))))
    assert replica_steps.decode_step_s(context.decode) > 0.010
    assert chunk_objective_s(context) == math.inf
    assert _chunk(context) == 512 - 3


@pytest.mark.parametrize("prompt_token_rate", [0.0, 2000.0])
def test_the_background_chunk_keeps_the_streams_inside_their_objective(prompt_token_rate):
    """As the streams wait through its step: stretched by the prompts arriving there,
    the way the scoring prices them (`as_streams_see`)."""
    d = replica("d1", **BUSY_STREAMS, prompt_token_rate=prompt_token_rate)
    chunks = []
    for slo_ms in (10, 20, 50):
        chunk = predict.background_chunk(RequestShape(1000, 32), d, slo_ms / 1000)
        step = replica_steps.step_s(COEFFS, chunk, 0, d.num_streams, d.stream_context)
        ((_, seen_s),) = replica_steps.as_streams_see(d, ((1.0, step),))
        assert seen_s <= slo_ms / 1000 * predict.STREAM_TPOT_MARGIN + 1e-9 or chunk == 1
        chunks.append(chunk)
    assert chunks == sorted(chunks) and chunks[-1] > 1


def test_prompts_arriving_at_the_decode_replica_shrink_the_background_chunk():
    quiet, busy = replica("d1", **BUSY_STREAMS), replica("d1", **BUSY_STREAMS, prompt_token_rate=2000.0)
    assert replica_steps.prompt_share(busy) == pytest.approx(0.2)
    shape = RequestShape(1000, 32)
    assert 1 < predict.background_chunk(shape, busy, 0.05) < predict.background_chunk(shape, quiet, 0.05)
