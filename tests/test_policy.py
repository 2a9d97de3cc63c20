"""The routing policy as a table: every mode, every reason."""

from __future__ import annotations

import pytest

from router.policy import ProfileView, RouteContext, decide

AUTO = ProfileView(mode="auto", min_remote_prefill_tokens=100, max_prefill_queue=2)


def ctx(**kw):
    base = {"prompt_len": 500, "num_cached_tokens": 0, "profile": AUTO, "num_healthy_prefill": 1,
            "prefill_queue_len": 0, "decode_has_room": True}
    base.update(kw)
    return RouteContext(**base)


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
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
        ({"profile": ProfileView(mode="local")}, ("local", "profile")),
        ({"profile": ProfileView(mode="disagg"), "prompt_len": 3}, ("disagg", "profile")),
        ({"profile": ProfileView(mode="disagg"), "num_healthy_prefill": 0}, ("local", "prefill-unhealthy")),
        ({"forced_mode": "local"}, ("local", "forced")),
        ({"forced_mode": "disagg", "prompt_len": 3}, ("disagg", "forced")),
        ({"forced_mode": "disagg", "num_healthy_prefill": 0}, ("local", "prefill-unhealthy")),
        ({"forced_mode": "auto", "profile": ProfileView(mode="local")}, ("disagg", "long-prompt")),
        ({"profile": ProfileView(mode="auto", min_remote_prefill_tokens=0, max_prefill_queue=0)},
         ("local", "prefill-busy")),
    ],
)
def test_decision_table(kw, expected):
    decision = decide(ctx(**kw))
    assert (decision.route, decision.reason) == expected


# The decode-busy guard: a busy prefill pool spills a prompt to the decode replica only
# where that prefill would not stall streams there (AUTO_GUARD: at most 300 uncached tokens).
AUTO_GUARD = ProfileView(mode="auto", min_remote_prefill_tokens=100, max_prefill_queue=2,
                         max_local_prefill_tokens_while_decoding=300)
BUSY = {"profile": AUTO_GUARD, "prefill_queue_len": 2}


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({**BUSY, "decode_num_requests": 0}, ("local", "prefill-busy")),  # nothing to stall
        ({**BUSY, "decode_num_requests": 1}, ("disagg", "long-prompt")),  # queue, keep decode clean
        ({**BUSY, "decode_num_requests": 5, "prompt_len": 2000}, ("disagg", "long-prompt")),
        ({**BUSY, "decode_num_requests": 1, "prompt_len": 300}, ("local", "prefill-busy")),  # small enough
        ({**BUSY, "decode_num_requests": 1, "prompt_len": 301}, ("disagg", "long-prompt")),
        ({**BUSY, "decode_num_requests": 1, "num_cached_tokens": 200}, ("local", "prefill-busy")),  # 300 uncached
        ({**BUSY, "decode_num_requests": 1, "prompt_len": 50}, ("local", "short-prompt")),
        ({**BUSY, "decode_num_requests": 1, "decode_has_room": False}, ("local", "decode-busy")),
        ({**BUSY, "decode_num_requests": 0, "decode_has_room": False}, ("local", "prefill-busy")),
        ({**BUSY, "decode_num_requests": 3, "prefill_queue_len": 1}, ("disagg", "long-prompt")),  # pool not busy
        ({**BUSY, "decode_num_requests": 3, "num_healthy_prefill": 0}, ("local", "prefill-unhealthy")),
        ({**BUSY, "decode_num_requests": 3, "forced_mode": "local"}, ("local", "forced")),
        ({"profile": ProfileView(mode="auto", min_remote_prefill_tokens=100, max_prefill_queue=2,
                                 max_local_prefill_tokens_while_decoding=0),
          "prefill_queue_len": 5, "decode_num_requests": 1}, ("disagg", "long-prompt")),
    ],
)
def test_decode_busy_guard(kw, expected):
    decision = decide(ctx(**kw))
    assert (decision.route, decision.reason) == expected


def test_never_disagg_without_prefill():
    for mode in ("auto", "disagg", "local"):
        for forced in (None, "auto", "disagg", "local"):
            d = decide(ctx(num_healthy_prefill=0, profile=ProfileView(mode=mode), forced_mode=forced))
            assert d.route == "local"
