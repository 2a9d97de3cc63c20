"""The router's planner without Ray: the prefix index it keeps, replica choice (prefix
affinity, then load), fallbacks, offload to an idle prefill replica, and the backlog and
stream counts the `auto` policy spills on."""

from __future__ import annotations

import pytest

from router.admin import parse_profile
from router.control_plane import ReplicaInfo
from router.errors import APIError
from router.placement import ClusterView
from router.policy import ProfileView
from router.prefix_index import PrefixIndex
from router.profiles import view
from workers.engine.prefix_hash import block_hashes

# ---- prefix index ------------------------------------------------------------------


def test_prefix_index_leading_run_and_lru():
    index = PrefixIndex(capacity_blocks=4)
    a = block_hashes(list(range(64)), 16)  # 4 blocks
    index.insert("r1", a[:3])
    assert index.num_matched_blocks("r1", a) == 3
    assert index.num_matched_blocks("r2", a) == 0
    b = block_hashes([7] * 32, 16)
    index.insert("r1", b)  # evicts the two oldest of a
    assert index.num_blocks("r1") == 4
    assert index.num_matched_blocks("r1", a) == 0  # the chain's first block is gone
    index.retain(["r2"])
    assert index.num_blocks("r1") == 0


# ---- planner -----------------------------------------------------------------------

AUTO = ProfileView("auto", min_remote_prefill_tokens=32, max_prefill_queue=2)


def replica(rid, role, **stats):
    return ReplicaInfo(rid, role, healthy=True, stats=stats)


def test_planner_prefers_prefix_affinity_then_load():
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode"), replica("d2", "decode", num_running=1), replica("p1", "prefill")])
    prompt = list(range(100))
    first = view.plan(prompt, 8, AUTO, None, offload_to_prefill=False)
    assert first.target_replica == "d1" and first.decision.route == "disagg"
    view.begin(first)
    view.end(first)
    view.update([replica("d1", "decode", num_running=3), replica("d2", "decode"), replica("p1", "prefill")])
    again = view.plan(prompt, 8, AUTO, None, offload_to_prefill=False)
    assert again.target_replica == "d1"  # the cached prefix wins over a little load
    assert again.num_cached_tokens == 96 and again.decision.reason == "prefix-hit"
    other = view.plan([5] * 100, 8, AUTO, None, offload_to_prefill=False)
    assert other.target_replica == "d2"  # no hit anywhere: least loaded


def test_planner_fallbacks_and_offload():
    view = ClusterView(block_size=16, max_num_seqs=8)
    with pytest.raises(APIError) as info:
        view.plan([1, 2, 3], 4, AUTO, None)
    assert info.value.status == 503
    view.update([replica("d1", "decode", num_running=2), replica("p1", "prefill")])
    short = view.plan([1, 2, 3], 4, AUTO, None)
    assert (short.deployment, short.target_replica, short.decision.reason) == ("prefill", "p1", "short-prompt")
    view.update([replica("p1", "prefill")])  # no decode replica: a prefill replica runs it whole
    assert view.plan([1, 2, 3], 4, AUTO, None).deployment == "prefill"
    view.update([replica("d1", "decode", kv_blocks_free=2), replica("p1", "prefill")])
    full = view.plan(list(range(100)), 8, AUTO, None, offload_to_prefill=False)
    assert full.decision.reason == "decode-busy"


def test_planner_spills_a_prompt_where_its_first_token_comes_sooner():
    """The planner counts the prompt tokens it has waiting for a first token on each
    replica and the streams past it; the policy spills on those (AutoPolicy)."""
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode"), replica("p1", "prefill")])
    profile = ProfileView("auto", min_remote_prefill_tokens=32, max_prefill_queue=4,
                          max_local_prefill_tokens_while_decoding=64)

    def plan(seed: int, n: int = 100):
        p = view.plan([seed] * n, 8, profile, None, offload_to_prefill=False)
        view.begin(p)
        return p

    first = plan(1)
    assert first.decision.route == "disagg" and view.backlog == {"p1": 100}  # an idle pool: remote
    second = plan(2)  # 100 ahead of it on p1, nothing on the idle d1: spill, in the background
    assert (second.decision.reason, second.decision.yield_prefill) == ("prefill-busy", True)
    assert view.backlog == {"p1": 100, "d1": 100}
    assert plan(3).decision.route == "disagg"  # equal waits: the prefill pool
    view.update([replica("d1", "decode"), replica("p1", "prefill", num_running=4)])  # queue at the cap
    capped = view.plan([5] * 40, 8, profile, None, offload_to_prefill=False)  # too small to yield
    assert (capped.decision.reason, capped.decision.yield_prefill) == ("prefill-busy", False)
    view.update([replica("d1", "decode"), replica("p1", "prefill")])
    for p in (first, second):
        view.prefill_done(p)  # first tokens back: both decode on d1 now
    assert view.backlog == {"p1": 100} and view.num_streams(view.replicas["d1"]) == 2
    # d1 streams: a spill runs ~3x slower there, so it must be clearly better
    assert plan(6).decision.route == "disagg"  # 3 * 100 vs 100 + 100 ahead: no
    assert plan(8).decision.route == "disagg"  # 3 * 100 vs 200 + 100 ahead: no
    third = plan(7)  # 300 ahead on p1 now: 3 * 100 < 400
    assert (third.decision.reason, third.decision.yield_prefill) == ("prefill-busy", True)
    for p in (first, second, third):
        view.end(p)
    assert view.num_streams(view.replicas["d1"]) == 0 and "d1" not in view.backlog


def test_decode_busy_guard_threshold_is_a_profile_field():
    full = {"mode": "auto", "min_remote_prefill_tokens": 256, "max_prefill_queue": 4,
            "allow_client_override": True}
    assert view(parse_profile("x", full)).max_local_prefill_tokens_while_decoding == 512  # optional
    profile = parse_profile("x", {**full, "max_local_prefill_tokens_while_decoding": 0})
    assert view(profile).max_local_prefill_tokens_while_decoding == 0
    with pytest.raises(APIError):
        parse_profile("x", {**full, "max_local_prefill_tokens_while_decoding": -1})
