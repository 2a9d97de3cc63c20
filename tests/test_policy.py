"""The routing policy as a table: every mode, every reason, and what n sequences, prompt
logprobs and a grammar change."""

from __future__ import annotations

import pytest

from cluster.config import WorkloadProfile
from router.policy import GUIDED_TOKEN_COST, RequestWork, RouteContext
from router.routing import decide
from workers.engine.sampling_params import GuidedDecoding, SamplingParams

AUTO = WorkloadProfile(mode="threshold", min_remote_prefill_tokens=100, max_prefill_queue=2)


def ctx(**kw):
    base = {"prompt_len": 500, "num_cached_tokens": 0, "profile": AUTO, "num_healthy_prefill": 1,
            "prefill_queue_len": 0, "decode_has_room": True}
    base.update(kw)
    return RouteContext(**base)


DECISIONS = [
        ({}, ("disagg", "long-prompt")),
        ({"prompt_len": 50}, ("local", "short-prompt")),
        ({"prompt_len": 99}, ("local", "short-prompt")),
        ({"prompt_len": 100}, ("disagg", "long-prompt")),
        ({"num_cached_tokens": 450}, ("local", "prefix-hit")),
        ({"num_cached_tokens": 400}, ("disagg", "long-prompt")),
        ({"prefill_queue_len": 2}, ("local", "prefill-busy")),
        ({"prefill_queue_len": 1}, ("disagg", "long-prompt")),
        ({"num_healthy_prefill": 0}, ("local", "prefill-unhealthy")),
        ({"decode_has_room": False}, ("local", "decode-busy")),
        ({"profile": WorkloadProfile(mode="local")}, ("local", "profile")),
        ({"profile": WorkloadProfile(mode="disagg"), "prompt_len": 3}, ("disagg", "profile")),
        ({"profile": WorkloadProfile(mode="disagg"), "num_healthy_prefill": 0}, ("local", "prefill-unhealthy")),
        ({"forced_mode": "local"}, ("local", "forced")),
        ({"forced_mode": "disagg", "prompt_len": 3}, ("disagg", "forced")),
        ({"forced_mode": "disagg", "num_healthy_prefill": 0}, ("local", "prefill-unhealthy")),
        ({"forced_mode": "threshold", "profile": WorkloadProfile(mode="local")}, ("disagg", "long-prompt")),
        ({"profile": WorkloadProfile(mode="threshold", min_remote_prefill_tokens=0, max_prefill_queue=0)},
         ("local", "prefill-busy")),
]


@pytest.mark.parametrize(("kw", "expected"), DECISIONS)
def test_decision_table(kw, expected):
    decision = decide(ctx(**kw))
    assert (decision.route, decision.reason) == expected


# Spilling to the decode replica: where the prompt's first token is expected sooner.
# The prompt has 500 uncached tokens; AUTO_SPILL lets a prompt of 300 or less spill in the
# foreground, a longer one prefills in the background (yield_prefill).
AUTO_SPILL = WorkloadProfile(mode="threshold", min_remote_prefill_tokens=100, max_prefill_queue=4,
                             max_local_prefill_tokens_while_decoding=300)
SPILL = {"profile": AUTO_SPILL}
BACKGROUND, FOREGROUND, REMOTE = ("local", "prefill-busy", True), ("local", "prefill-busy", False), \
    ("disagg", "long-prompt", False)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({**SPILL}, REMOTE),  # both idle: disaggregation is free
        ({**SPILL, "prefill_backlog_tokens": 1}, BACKGROUND),  # idle decode replica: 500 < 501
        ({**SPILL, "prefill_backlog_tokens": 1, "prompt_len": 300}, FOREGROUND),  # small enough
        ({**SPILL, "prefill_backlog_tokens": 1, "prompt_len": 50}, ("local", "short-prompt", False)),
        ({**SPILL, "prefill_backlog_tokens": 400, "decode_backlog_tokens": 400}, REMOTE),  # equal
        ({**SPILL, "prefill_backlog_tokens": 401, "decode_backlog_tokens": 400}, BACKGROUND),
        ({**SPILL, "prefill_backlog_tokens": 1000, "decode_num_streams": 2}, REMOTE),  # 3*500 = 1500
        ({**SPILL, "prefill_backlog_tokens": 1001, "decode_num_streams": 2}, BACKGROUND),
        ({**SPILL, "prefill_queue_len": 4}, BACKGROUND),  # the pool's queue cap
        ({**SPILL, "prefill_queue_len": 4, "decode_backlog_tokens": 1}, REMOTE),  # never the longer queue
        ({**SPILL, "prefill_queue_len": 3, "decode_num_streams": 9}, REMOTE),
        ({**SPILL, "prefill_backlog_tokens": 9000, "decode_has_room": False}, BACKGROUND),
        ({**SPILL, "decode_has_room": False}, ("local", "decode-busy", False)),
        ({**SPILL, "prefill_backlog_tokens": 9000, "num_healthy_prefill": 0}, ("local", "prefill-unhealthy", False)),
        ({**SPILL, "prefill_backlog_tokens": 9000, "forced_mode": "disagg"}, ("disagg", "forced", False)),
    ],
)
def test_spill_table(kw, expected):
    decision = decide(ctx(**kw))
    assert (decision.route, decision.reason, decision.yield_prefill) == expected


def test_never_disagg_without_prefill():
    for mode in ("auto", "threshold", "disagg", "local"):
        for forced in (None, "auto", "threshold", "disagg", "local"):
            d = decide(ctx(num_healthy_prefill=0, profile=WorkloadProfile(mode=mode), forced_mode=forced))
            assert d.route == "local"


# ---- the work a request asks for --------------------------------------------------------

LOGPROBS = RequestWork(prompt_logprobs=True)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        # A prompt whose logprobs are wanted is computed whole: a cached prefix is no hit.
        ({"num_cached_tokens": 450}, ("disagg", "long-prompt", False)),
        ({"num_cached_tokens": 499, "profile": WorkloadProfile(mode="threshold", min_remote_prefill_tokens=500)},
         ("disagg", "long-prompt", False)),
        ({"prompt_len": 99, "num_cached_tokens": 64}, ("local", "short-prompt", False)),  # never prefix-hit
        # Its whole prompt is what a spill compares: 500 > 300 prefills in the background.
        ({**SPILL, "num_cached_tokens": 450, "prefill_backlog_tokens": 1}, BACKGROUND),
        ({**SPILL, "num_cached_tokens": 450, "prefill_backlog_tokens": 1, "prompt_len": 300}, FOREGROUND),
        ({"num_cached_tokens": 450, "decode_has_room": False}, ("local", "decode-busy", False)),
    ],
)
def test_prompt_logprobs_table(kw, expected):
    context = ctx(work=LOGPROBS, **kw)
    assert context.num_uncached_tokens == context.prompt_len
    decision = decide(context)
    assert (decision.route, decision.reason, decision.yield_prefill) == expected


@pytest.mark.parametrize("work", [RequestWork(num_sequences=4), RequestWork(guided=True),
                                  RequestWork(num_sequences=3, guided=True)])
@pytest.mark.parametrize(("kw", "expected"), DECISIONS)
def test_streams_and_grammar_change_only_the_counts(work, kw, expected):
    """n streams and a grammar decode where the request decodes on either route: the
    policy sees them through the counts placement fills (room, streams), so for the same
    counts the decision is the plain request's."""
    decision = decide(ctx(work=work, **kw))
    assert (decision.route, decision.reason) == expected


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), RequestWork(1, False, False)),
        (SamplingParams(n=3), RequestWork(3, False, False)),
        (SamplingParams(n=2, best_of=5), RequestWork(5, False, False)),
        (SamplingParams(prompt_logprobs=0), RequestWork(1, True, False)),
        (SamplingParams(logprobs=5), RequestWork(1, False, False)),  # generated tokens' only
        (SamplingParams(guided=GuidedDecoding("regex", "[ab]+")), RequestWork(1, False, True)),
    ],
)
def test_request_work_from_sampling_params(params, expected):
    assert RequestWork.of(params) == expected


def test_decode_cost_counts_streams_and_grammar_time():
    assert RequestWork().decode_cost == 1.0
    assert RequestWork(num_sequences=4).decode_cost == 4.0
    assert RequestWork(num_sequences=2, guided=True).decode_cost == pytest.approx(2 / 0.91)
    assert GUIDED_TOKEN_COST == pytest.approx(1 / 0.91)
