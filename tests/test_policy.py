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


def test_never_disagg_without_prefill():
    for mode in ("auto", "disagg", "local"):
        for forced in (None, "auto", "disagg", "local"):
            d = decide(ctx(num_healthy_prefill=0, profile=ProfileView(mode=mode), forced_mode=forced))
            assert d.route == "local"
