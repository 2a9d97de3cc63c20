"""Placement without Ray: replica choice (prefix affinity, then load), fallbacks,
offload to an idle prefill replica, the backlog and stream counts the `auto` policy
spills on, what n sequences and prompt logprobs change, and that placement and the
policy import no web or Ray code (a simulator runs them in a plain process). The prefix
index it reads is tests/test_prefix_index.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cluster.config import WorkloadProfile
from router.admin import parse_profile
from router.cluster_view import ClusterView, ReplicaInfo
from router.errors import APIError
from router.placement import place
from router.policy import RequestWork

AUTO = WorkloadProfile(mode="threshold", min_remote_prefill_tokens=32, max_prefill_queue=2)


def replica(rid, role, **stats):
    return ReplicaInfo(rid, role, healthy=True, stats=stats)


def test_placement_prefers_prefix_affinity_then_load():
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode"), replica("d2", "decode", num_running=1), replica("p1", "prefill")])
    prompt = list(range(100))
    first = place(view, prompt, 8, AUTO, None, offload_to_prefill=False)
    assert first.target_replica == "d1" and first.decision.route == "disagg"
    view.begin(first)
    view.end(first)
    view.update([replica("d1", "decode", num_running=3), replica("d2", "decode"), replica("p1", "prefill")])
    again = place(view, prompt, 8, AUTO, None, offload_to_prefill=False)
    assert again.target_replica == "d1"  # the cached prefix wins over a little load
    assert again.num_cached_tokens == 96 and again.decision.reason == "prefix-hit"
    other = place(view, [5] * 100, 8, AUTO, None, offload_to_prefill=False)
    assert other.target_replica == "d2"  # no hit anywhere: least loaded


def test_placement_fallbacks_and_offload():
    view = ClusterView(block_size=16, max_num_seqs=8)
    with pytest.raises(APIError) as info:
        place(view, [1, 2, 3], 4, AUTO, None)
    assert info.value.status == 503
    view.update([replica("d1", "decode", num_running=2), replica("p1", "prefill")])
    short = place(view, [1, 2, 3], 4, AUTO, None)
    assert (short.deployment, short.target_replica, short.decision.reason) == ("prefill", "p1", "short-prompt")
    view.update([replica("p1", "prefill")])  # no decode replica: a prefill replica runs it whole
    assert place(view, [1, 2, 3], 4, AUTO, None).deployment == "prefill"
    view.update([replica("d1", "decode", kv_blocks_free=2), replica("p1", "prefill")])
    full = place(view, list(range(100)), 8, AUTO, None, offload_to_prefill=False)
    assert full.decision.reason == "decode-busy"


def test_placement_spills_a_prompt_where_its_first_token_comes_sooner():
    """Placement counts the prompt tokens it has waiting for a first token on each
    replica and the streams past it; the policy spills on those (AutoPolicy)."""
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode"), replica("p1", "prefill")])
    profile = WorkloadProfile(mode="threshold", min_remote_prefill_tokens=32, max_prefill_queue=4,
                              max_local_prefill_tokens_while_decoding=64)

    def placed(seed: int, n: int = 100):
        p = place(view, [seed] * n, 8, profile, None, offload_to_prefill=False)
        view.begin(p)
        return p

    first = placed(1)
    assert first.decision.route == "disagg" and view.backlog == {"p1": 100}  # an idle pool: remote
    second = placed(2)  # 100 ahead of it on p1, nothing on the idle d1: spill, in the background
    assert (second.decision.reason, second.decision.yield_prefill) == ("prefill-busy", True)
    assert view.backlog == {"p1": 100, "d1": 100}
    assert placed(3).decision.route == "disagg"  # equal waits: the prefill pool
    view.update([replica("d1", "decode"), replica("p1", "prefill", num_running=4)])  # queue at the cap
    capped = place(view, [5] * 40, 8, profile, None, offload_to_prefill=False)  # too small to yield
    assert (capped.decision.reason, capped.decision.yield_prefill) == ("prefill-busy", False)
    view.update([replica("d1", "decode"), replica("p1", "prefill")])
    for p in (first, second):
        view.prefill_done(p)  # first tokens back: both decode on d1 now
    assert view.backlog == {"p1": 100} and view.num_streams(view.replicas["d1"]) == 2
    # d1 streams: a spill runs ~3x slower there, so it must be clearly better
    assert placed(6).decision.route == "disagg"  # 3 * 100 vs 100 + 100 ahead: no
    assert placed(8).decision.route == "disagg"  # 3 * 100 vs 200 + 100 ahead: no
    third = placed(7)  # 300 ahead on p1 now: 3 * 100 < 400
    assert (third.decision.reason, third.decision.yield_prefill) == ("prefill-busy", True)
    for p in (first, second, third):
        view.end(p)
    assert view.num_streams(view.replicas["d1"]) == 0 and "d1" not in view.backlog


def test_a_request_behind_a_long_remote_queue_is_not_yet_a_stream_where_it_will_decode():
    """Counted once its predicted first token is within the horizon (or late), not while
    it waits behind a long prefill queue."""
    from router.incoming import incoming_horizon_s

    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode"), replica("p1", "prefill")])
    far = place(view, [1] * 100, 8, WorkloadProfile(mode="disagg"), None, offload_to_prefill=False)
    far = dataclasses.replace(far, decision=dataclasses.replace(
        far.decision, prediction=dataclasses.replace(far.decision.prediction, ttft_s=30.0)), placed_at=100.0)
    view.begin(far)
    assert view.incoming_soon("d1", now=100.0) == (0, 0)
    horizon = incoming_horizon_s(far.max_tokens, far.decision.prediction.tpot_s)
    assert 0 < horizon < 1.0  # 7 gaps of a tiny model's predicted decode
    assert view.incoming_soon("d1", now=130.0 - 2 * horizon) == (0, 0)
    assert view.incoming_soon("d1", now=130.0 - horizon) == (1, 100)
    assert view.incoming_soon("d1", now=200.0) == (1, 100)  # late: any moment now
    assert view.incoming_soon("d1") == (1, 100)  # no clock: every one
    assert view.load_of(view.replicas["d1"], now=100.0).num_streams == 0
    # not a stream yet, but due: the local candidates there see when (`incoming_due_s`)
    d1 = view.replicas["d1"]
    assert view.load_of(d1, now=100.0, arrival_objectives=True).incoming_due_s == ()  # 30 s off: past 5 s
    assert view.load_of(d1, now=127.0, arrival_objectives=True).incoming_due_s == pytest.approx((3.0,))
    assert view.load_of(d1, now=127.0).incoming_due_s == ()  # only the decode replica's local candidates read it
    assert view.load_of(d1, now=130.0 - horizon, arrival_objectives=True).incoming_due_s == ()  # a stream now
    view.end(far)
    assert view.incoming == {}


def test_the_incoming_horizon_is_the_requests_own_decode():
    from router.incoming import INCOMING_HORIZON_S, incoming_horizon_s

    assert incoming_horizon_s(16, 0.025) == 15 * 0.025  # joins before a stream like it placed now is done
    assert incoming_horizon_s(1, 0.025) == 0.0  # one token: it never decodes beside anything (late ones count)
    assert incoming_horizon_s(4096, 0.05) == INCOMING_HORIZON_S
    assert incoming_horizon_s(16, float("inf")) == INCOMING_HORIZON_S


def test_a_stream_is_held_to_the_tpot_budget_it_has_left():
    """A 17-token request under a 50 ms TPOT objective has 800 ms for its 16 gaps. Before
    its first token it is held to the objective; after 5 tokens in 0.4 s it may take
    (800 - 400) / 12 ms a gap; past its budget it is left out; ended, it is gone."""
    from cluster.config import SLO
    from router.placement import PolicyInputs

    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode")])
    local = WorkloadProfile(mode="local")
    inputs = PolicyInputs(slo=SLO(ttft_ms=1000, tpot_ms=50), now=10.0)
    p = place(view, [1] * 40, 17, local, None, offload_to_prefill=False, inputs=inputs)
    assert p.max_tokens == 17
    view.begin(p)
    d = view.replicas["d1"]
    assert view.load_of(d, now=10.0).stream_tpot_slo_s == pytest.approx(0.050)
    assert view.queued_here("d1") == (1, 40, 17)  # queued to prefill here, then decoding here
    view.prefill_done(p, now=11.0, num_tokens=1)
    assert view.queued_here("d1") == (0, 0, 0)
    view.streamed(p, 4)
    assert view.load_of(d, now=11.4).stream_tpot_slo_s == pytest.approx((0.8 - 0.4) / 12)
    assert view.load_of(d, now=11.9).stream_tpot_slo_s == float("inf")  # past reach
    assert view.load_of(d).stream_tpot_slo_s == pytest.approx(0.050)  # no clock: the objective
    view.end(p)
    assert view.load_of(d, now=12.0).stream_tpot_slo_s is None and view.slo_streams == {}


def test_n_sequences_count_n_streams_where_they_decode():
    """A request of 4 sequences: 4 in flight and 4 streams on its decode replica after the
    first token, one prefill on the prefill replica; the next request sees that load."""
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode"), replica("d2", "decode"), replica("p1", "prefill")])
    four = place(view, [1] * 100, 8, AUTO, None, offload_to_prefill=False, work=RequestWork(num_sequences=4))
    assert (four.target_replica, four.decision.route, four.num_sequences) == ("d1", "disagg", 4)
    view.begin(four)
    assert view.inflight == {"d1": 4, "p1": 1} and view.awaiting_first == {"d1": 4}
    assert view.num_streams(view.replicas["d1"]) == 0
    # still prefilling on p1, but the predictions already see 4 streams of 100 tokens on d1
    incoming = view.load_of(view.replicas["d1"])
    assert (incoming.num_streams, incoming.stream_context) == (4, 400)
    view.prefill_done(four)
    assert view.inflight == {"d1": 4} and view.num_streams(view.replicas["d1"]) == 4
    decoding = view.load_of(view.replicas["d1"])
    assert (decoding.num_streams, view.incoming) == (4, {})
    one = place(view, [2] * 100, 8, AUTO, None, offload_to_prefill=False)
    assert one.target_replica == "d2"  # d1 holds 4 streams
    view.end(four)
    assert view.inflight == {} and view.awaiting_first == {} and view.backlog == {}


@pytest.mark.parametrize(
    ("num_sequences", "stats", "busy"),
    [
        (3, {"num_running": 5}, False),  # 5 + 3 seats of 8
        (4, {"num_running": 5}, True),
        (12, {}, False),  # more than max_num_seqs: the scheduler runs it once the replica is empty
        (12, {"num_running": 1}, True),
        # 100 prompt tokens, 8 more each: 6 shared full blocks + one own block per sequence
        (4, {"kv_blocks_free": 10}, False),
        (4, {"kv_blocks_free": 9}, True),
        (1, {"kv_blocks_free": 7}, False),
        (1, {"kv_blocks_free": 6}, True),
    ],
)
def test_decode_room_counts_every_sequence(num_sequences, stats, busy):
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode", **stats), replica("p1", "prefill")])
    placed = place(view, list(range(100)), 8, AUTO, None, offload_to_prefill=False,
                   work=RequestWork(num_sequences=num_sequences))
    assert (placed.decision.reason == "decode-busy") is busy


def test_prompt_logprobs_ignore_cached_prefixes():
    """A request for prompt logprobs recomputes its whole prompt: no replica's cached
    prefix attracts it, shortens its backlog, or makes it a `prefix-hit`; its blocks are
    still recorded where it runs (the engine registers them)."""
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode"), replica("d2", "decode"), replica("p1", "prefill")])
    prompt = list(range(100))
    first = place(view, prompt, 8, AUTO, None, offload_to_prefill=False)
    view.begin(first)
    view.end(first)
    assert first.target_replica == "d1"
    view.update([replica("d1", "decode", num_running=1), replica("d2", "decode"), replica("p1", "prefill")])
    plain = place(view, prompt, 8, AUTO, None, offload_to_prefill=False)
    assert (plain.target_replica, plain.decision.reason) == ("d1", "prefix-hit")
    scored = place(view, prompt, 8, AUTO, None, offload_to_prefill=False, work=RequestWork(prompt_logprobs=True))
    assert (scored.target_replica, scored.num_cached_tokens) == ("d2", 0)  # least loaded, no hit
    assert (scored.decision.route, scored.decision.reason, scored.prefill_tokens) == ("disagg", "long-prompt", 100)
    view.begin(scored)
    assert view.index.num_matched_blocks("d2", scored.hashes) == 6
    short = WorkloadProfile(mode="local")
    local = place(view, prompt, 8, short, None, offload_to_prefill=False, work=RequestWork(prompt_logprobs=True))
    assert (local.num_cached_tokens, local.prefill_tokens) == (0, 100)


def test_decode_busy_guard_threshold_is_a_profile_field():
    full = {"mode": "auto", "min_remote_prefill_tokens": 256, "max_prefill_queue": 4,
            "allow_client_override": True}
    assert parse_profile("x", full).max_local_prefill_tokens_while_decoding == 512  # optional
    profile = parse_profile("x", {**full, "max_local_prefill_tokens_while_decoding": 0})
    assert profile.max_local_prefill_tokens_while_decoding == 0
    with pytest.raises(APIError):
        parse_profile("x", {**full, "max_local_prefill_tokens_while_decoding": -1})


def test_placement_and_policy_import_no_web_or_ray_code():
    """A simulator runs the same placement and policy code in a plain process: importing
    and running it loads neither Ray nor FastAPI nor Starlette."""
    code = textwrap.dedent("""
        import sys
        from cluster.config import WorkloadProfile
        from router.cluster_view import ClusterView, ReplicaInfo
        from router.placement import place
        from router.policy import RouteContext
        from router.routing import decide
        from router.prefix_index import PrefixIndex
        from router.profiles import Profiles, client_mode

        profiles = Profiles(1, {"default": WorkloadProfile()})
        profile = profiles.get(profiles.resolve("chat"))
        view = ClusterView(block_size=16, max_num_seqs=8)
        view.update([ReplicaInfo("d1", "decode"), ReplicaInfo("p1", "prefill")])
        for n in (3, 300):
            placement = place(view, list(range(n)), 8, profile, client_mode(profile, "auto"))
            view.begin(placement)
            view.prefill_done(placement)
            view.end(placement)
        try:
            place(ClusterView(16, 8), [1, 2, 3], 8, profile, None)
        except Exception as e:
            assert getattr(e, "status", None) == 503, e
        decide(RouteContext(prompt_len=10, num_cached_tokens=0, profile=profile))
        PrefixIndex()
        print(sorted(m for m in ("ray", "fastapi", "starlette") if m in sys.modules))
    """)
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=root)
    assert out.stdout.strip() == "[]"


def test_a_prompt_waiting_past_its_predicted_ttft_prices_its_path_as_slow_before_it_finishes():
    """The first prompt runs locally, predicted ~70 ms. While it has not got its first
    token half a second later, the local path on d1 is priced as that late (the next
    prompt's local TTFT times how late it is) and the next prompt goes remote; once it answers, local is priced by the model again (and once it
    is done, with no stream to protect, the next prompt prefills locally)."""
    from router.placement import PolicyInputs

    predictive = WorkloadProfile(mode="auto")
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([replica("d1", "decode"), replica("p1", "prefill")])

    def placed(now: float, token: int):
        return place(view, [token] * 600, 8, predictive, None, offload_to_prefill=False, inputs=PolicyInputs(now=now))

    def local_ttft(placement) -> float:
        return next(a.prediction.ttft_s for a in placement.decision.alternatives if a.candidate.kind == "local")

    first = placed(0.0, 1)
    assert (first.decision.route, first.placed_at) == ("local", 0.0)
    view.begin(first)
    on_time = placed(0.0, 2)
    assert view.overdue_of("d1", 0.0) == {}
    late = view.overdue_of("d1", 0.5)
    assert late["local"] == pytest.approx(0.5 / (first.decision.prediction.ttft_s + 0.05))
    overdue = placed(0.5, 2)
    assert local_ttft(overdue) == pytest.approx(local_ttft(on_time) * late["local"], rel=1e-6)
    assert overdue.decision.route == "disagg"
    assert view.overdue_of("d1", 100.0) == {"local": 8.0}  # one request counts as at most 8x
    view.prefill_done(first)
    assert view.waiting == {} and view.overdue_of("d1", 0.5) == {}
    view.end(first)
    assert placed(0.5, 2).decision.route == "local"


CONTENDED_MODEL = {"fixed_s": 0.01, "prefill_token_s": 1e-4, "prefill_attention_s": 0.0, "decode_seq_s": 1e-3,
                   "decode_context_s": 0.0, "num_samples": 64, "node_contention": 0.4}


def test_a_replica_load_counts_the_busy_replicas_of_its_node():
    def info(rid, role, node="n1", healthy=True, **stats):
        return ReplicaInfo(rid, role, node_id=node, healthy=healthy, stats={"step_model": CONTENDED_MODEL, **stats})

    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([info("d1", "decode", num_running=2), info("p1", "prefill", num_waiting=1),
                 info("p2", "prefill"),  # idle
                 info("p3", "prefill", node="n2", num_running=1),  # another machine
                 info("p4", "prefill", healthy=False, num_running=1),
                 info("x1", "decode", node="", num_running=1)])  # node unknown
    loads = {rid: view.load_of(view.replicas[rid]) for rid in view.replicas}
    assert loads["d1"].node_busy == 1.0 and loads["d1"].node_id == "n1"
    assert loads["p2"].node_busy == 2.0
    assert loads["p3"].node_busy == 0.0 and loads["x1"].node_busy == 0.0
    assert loads["p1"].shares_node_with(loads["d1"]) and not loads["p3"].shares_node_with(loads["d1"])
    assert not loads["x1"].shares_node_with(dataclasses.replace(loads["x1"], replica_id="x2"))
    # each busy neighbour slows the steps it prices by the learned factor; k stays for what one more adds
    assert loads["p2"].coefficients.fixed_s == pytest.approx(0.01 * 1.8)
    assert loads["p3"].coefficients.fixed_s == pytest.approx(0.01)
    assert loads["p2"].coefficients.node_contention == 0.4
    alone = dict(CONTENDED_MODEL, node_contention=0.0)
    view.update([ReplicaInfo("d1", "decode", node_id="n1", stats={"num_running": 1, "step_model": alone}),
                 ReplicaInfo("p1", "prefill", node_id="n1", stats={"num_running": 1, "step_model": alone})])
    assert view.load_of(view.replicas["d1"]).coefficients.fixed_s == pytest.approx(0.01)  # nothing learned


def test_a_load_evolves_as_dataclasses_replace_would_and_refuses_unknown_fields():
    view = ClusterView(block_size=16, max_num_seqs=8)
    view.update([ReplicaInfo("d1", "decode", node_id="n1", stats={"step_model": CONTENDED_MODEL, "num_running": 2})])
    base = view.load_of(view.replicas["d1"])
    changes = {"queue_tokens": 77, "num_streams": 5, "overdue": {"local": 1.5}, "stream_allowances": (0.02,)}
    evolved = base.evolve(**changes)
    assert evolved == dataclasses.replace(base, **changes) and type(evolved) is type(base)
    assert base.queue_tokens != 77  # the original is untouched
    with pytest.raises(TypeError, match="queue_tokenz"):
        base.evolve(queue_tokenz=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        evolved.queue_tokens = 1
