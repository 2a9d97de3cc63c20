"""The simulator routes with the real placement and policy code: `threshold` sends
short prompts local and long ones remote by its rule, `auto` decides from predictions
with reasons from the closed list and learns from outcomes, profiles apply per
workload, and shared prefixes hit the replicas' caches where affinity sends them."""

from __future__ import annotations

import json

from cluster.config import SLO, WorkloadProfile
from cluster.loadtest.workloads import RequestSpec
from cluster.plan.sim import SimConfig, at_rate
from cluster.plan.sim.arrivals import Arrival
from cluster.plan.sim.simulator import Simulation
from tests.plan_sim_support import calibration, spec
from workers.protocol import REASONS


def _spread(lengths: list[int], gap_s: float, workload: str = "default") -> list[Arrival]:
    return [Arrival(i * gap_s, spec(i, n, 8, workload)) for i, n in enumerate(lengths)]


def test_threshold_routes_short_prompts_local_and_long_ones_remote():
    profile = WorkloadProfile(mode="threshold", min_remote_prefill_tokens=300)
    lengths = [64, 900, 200, 299, 300, 1500, 120, 700] * 4
    config = SimConfig(num_prefill=1, num_decode=1, profiles={"default": profile}, offload_local_to_prefill=False)
    result = Simulation(config, calibration()).run(_spread(lengths, 0.5))
    for r, n in zip(result.records, lengths, strict=True):
        assert (r.route, r.reason) == (("disagg", "long-prompt") if n >= 300 else ("local", "short-prompt"))


def test_threshold_spills_to_the_decode_replica_when_the_prefill_queue_is_full():
    """`max_prefill_queue` 1 and a burst of long prompts: once the prefill replica holds
    one, the next ones prefill where they decode (`prefill-busy`), as `ThresholdPolicy` says."""
    profile = WorkloadProfile(mode="threshold", min_remote_prefill_tokens=100, max_prefill_queue=1)
    config = SimConfig(num_prefill=1, num_decode=1, profiles={"default": profile}, offload_local_to_prefill=False)
    result = Simulation(config, calibration()).run(_spread([800] * 6, 0.001))
    reasons = [r.reason for r in result.records]
    assert reasons[0] == "long-prompt"
    assert "prefill-busy" in reasons
    assert {r.route for r in result.records if r.reason == "prefill-busy"} == {"local"}


def test_auto_decides_from_predictions_with_reasons_from_the_closed_list_and_learns():
    profile = WorkloadProfile(mode="auto", slo=SLO(ttft_ms=400, tpot_ms=30))
    config = SimConfig(num_prefill=1, num_decode=2, profiles={"default": profile})
    sim = Simulation(config, calibration())
    result = sim.run(at_rate("mixed", 25.0, 400, seed=0))
    assert {r.reason for r in result.records} <= set(REASONS)
    assert {r.route for r in result.records} == {"local", "disagg"}
    assert all(r.predicted_ttft_s is not None and r.predicted_ttft_s > 0 for r in result.records)
    state = sim.router.corrections.snapshot()
    keys = {key for _, key, _ in state.corrections}
    assert {"local", "disagg", "streams"} <= keys <= {"local", "disagg", "background", "streams",
                                                      "local:long", "disagg:long", "background:long"}
    summary = result.summary()
    assert summary.prediction_error  # the load tester's own summary compares prediction with outcome
    assert sim.router.num_decisions == len(result.records)


def test_profiles_apply_per_workload():
    profiles = {"default": WorkloadProfile(mode="local"), "rag": WorkloadProfile(mode="disagg")}
    arrivals = [Arrival(i * 0.2, spec(i, 300, 8, "rag" if i % 2 else "chat")) for i in range(20)]
    result = Simulation(SimConfig(num_prefill=1, num_decode=1, profiles=profiles, offload_local_to_prefill=False),
                        calibration()).run(arrivals)
    for r in result.records:
        assert r.route == ("disagg" if r.workload == "rag" else "local")


def test_an_idle_prefill_replica_runs_a_local_request_whole():
    """Two short requests at once: the decode replica has the first; the second goes whole
    to the idle prefill replica (placement's role-flexible route) and runs there."""
    config = SimConfig(num_prefill=1, num_decode=1, profiles={"default": WorkloadProfile(mode="local")})
    sim = Simulation(config, calibration())
    result = sim.run([Arrival(0.0, spec(0, 64, 50)), Arrival(0.001, spec(1, 64, 50))])
    assert [r.route for r in result.records] == ["local", "local"]
    assert sim.engines["prefill-0"].busy_s > 0
    assert sim.requests[1].placement.deployment == "prefill"


def _shared_prefix_run(enable_prefix_caching: bool) -> tuple[Simulation, object]:
    prefixes = ["x" * 400, "y" * 400]
    arrivals = [Arrival(i * 0.05, RequestSpec(f"r{i}", "default", (
        {"role": "system", "content": prefixes[i % 2]}, {"role": "user", "content": f"question {i:04d}"}), 8))
        for i in range(60)]
    config = SimConfig(num_prefill=0, num_decode=2, profiles={"default": WorkloadProfile(mode="local")})
    sim = Simulation(config, calibration(enable_prefix_caching=enable_prefix_caching))
    return sim, sim.run(arrivals)


def test_shared_prefixes_hit_the_cache_where_affinity_sends_them():
    sim, result = _shared_prefix_run(True)
    hits = sum(e.cache.num_hit_tokens for e in sim.engines.values())
    queried = sum(e.cache.num_queried_tokens for e in sim.engines.values())
    assert hits > 0.6 * queried  # the real prefix index keeps each prefix on the replica that holds it
    by_prefix = {}
    for req in sim.requests:
        by_prefix.setdefault(req.index % 2, set()).add(req.placement.target_replica)
    assert all(len(replicas) == 1 for replicas in by_prefix.values())
    cold_sim, cold = _shared_prefix_run(False)
    assert sum(e.cache.num_hit_tokens for e in cold_sim.engines.values()) == 0
    assert result.summary().ttft_ms["mean"] < cold.summary().ttft_ms["mean"]


def test_arrivals_are_the_load_testers_plans(tmp_path):
    """A built-in at a rate is `build_plan`'s schedule; a `trace.jsonl` (the rows `pdcluster
    bench cluster` writes) keeps its offsets, lengths and per-row workloads."""
    from cluster.loadtest.config import LoadTestConfig
    from cluster.loadtest.runner import build_plan
    from cluster.plan.sim import from_trace

    arrivals = at_rate("mixed", 12.0, 30, seed=5)
    plan = build_plan(LoadTestConfig("http://x", workload="mixed", rate=12.0, num_requests=30, seed=5))
    assert [a.at_s for a in arrivals] == plan.offsets and [a.spec for a in arrivals] == plan.specs
    rows = [{"timestamp": 100.0 + 0.25 * i, "id": f"t{i}", "prompt_len": 40 + 300 * (i % 2), "output_len": 4,
             "workload": "rag" if i % 2 else "chat"} for i in range(8)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    replayed = from_trace(trace)
    assert [a.at_s for a in replayed] == [0.25 * i for i in range(8)]
    profiles = {"default": WorkloadProfile(mode="local"), "rag": WorkloadProfile(mode="disagg")}
    result = Simulation(SimConfig(num_prefill=1, num_decode=1, profiles=profiles, offload_local_to_prefill=False),
                        calibration()).run(replayed)
    assert [(r.request_id, r.target_prompt_len, r.route) for r in result.records] == [
        (f"t{i}", 40 + 300 * (i % 2), "disagg" if i % 2 else "local") for i in range(8)]


def test_between_heartbeats_the_view_counts_its_own_requests():
    """Heartbeats every 30 s: a burst of 40 requests within 0.2 s still spreads evenly over
    four decode replicas, because the real view counts what it sent since the last one
    (the run ends long before a heartbeat after the first); at 0.1 s they keep arriving."""
    config = SimConfig(num_prefill=0, num_decode=4, profiles={"default": WorkloadProfile(mode="local")},
                       heartbeat_interval_s=30.0, poll_interval_s=30.0)
    sim = Simulation(config, calibration())
    sim.run([Arrival(0.005 * i, spec(i, 64, 200)) for i in range(40)])
    counts: dict[str, int] = {}
    for req in sim.requests:
        counts[req.placement.target_replica] = counts.get(req.placement.target_replica, 0) + 1
    assert sorted(counts.values()) == [10, 10, 10, 10]
    assert sim.events.now < 30.0
    assert {info.last_heartbeat for info in sim.router.view.replicas.values()} == {0.0}
    fast = Simulation(SimConfig(num_prefill=0, num_decode=4, profiles=config.profiles, heartbeat_interval_s=0.1,
                                poll_interval_s=0.1), calibration())
    fast.run([Arrival(0.005 * i, spec(i, 64, 200)) for i in range(40)])
    assert fast.events.now > 0.5
    assert min(info.last_heartbeat for info in fast.router.view.replicas.values()) > fast.events.now - 0.25


def test_auto_protects_streams_with_the_background_chunk_it_chose():
    """Ten streams decode on the only replica under a tight TPOT objective; a long prompt
    arrives whose foreground chunks (0.2 s each) would push the streams' mean gap past it:
    `auto` prefills it in the background (with no prefill pool its reason is
    `prefill-unhealthy`), and the engine takes it in chunks of the size the decision
    carries, so the streams' gaps stay inside their objective."""
    profile = WorkloadProfile(mode="auto", slo=SLO(ttft_ms=20000, tpot_ms=8))
    sim = Simulation(SimConfig(num_prefill=0, num_decode=1, profiles={"default": profile}),
                     calibration(fixed_s=0.004, prefill_token_s=2e-4, decode_seq_s=2e-4))
    arrivals = [Arrival(0.001 * i, spec(i, 64, 300)) for i in range(10)] + [Arrival(0.5, spec(10, 3000, 4))]
    result = sim.run(arrivals)
    long = result.records[10]
    decision = sim.requests[10].placement.decision
    assert (long.route, long.reason) == ("local", "prefill-unhealthy")
    assert decision.candidate.kind == "background" and decision.yield_prefill
    chunk = decision.chunk_tokens
    assert 1 <= chunk < 1024
    # the streams' gaps while it prefilled: a decode step plus at most one chunk of it
    limit = 0.004 + 10 * 2e-4 + chunk * 2e-4 + 1e-9
    for req in sim.requests[:10]:
        times = req.token_times()
        gaps = [b - a for a, b in zip(times, times[1:], strict=False) if a >= 0.5]
        assert gaps and max(gaps) <= limit <= 0.008
    # a chunk per decoding step until the streams were done: far slower than three full chunks
    assert long.ttft_s > 2 * 3 * (0.004 + 1024 * 2e-4)


def test_a_simulated_transfers_tail_reaches_the_router_as_a_live_one_does():
    """Each remote request's outcome carries its KV's time on the simulated network, as
    a live stream brings back the prefill replica's measured tail; local ones carry none."""
    profile = WorkloadProfile(mode="threshold", min_remote_prefill_tokens=300)
    config = SimConfig(num_prefill=1, num_decode=1, profiles={"default": profile}, offload_local_to_prefill=False)
    sim = Simulation(config, calibration())
    seen = []
    observe = sim.router.corrections.observe
    sim.router.corrections.observe = lambda outcome, now: (seen.append(outcome), observe(outcome, now))
    sim.run(_spread([64, 900] * 3, 0.5))
    assert sorted(o.route for o in seen) == ["disagg"] * 3 + ["local"] * 3
    assert all((o.measured_transfer_s is None) == (o.route == "local") for o in seen)
    assert all(o.measured_transfer_s > 0 for o in seen if o.route == "disagg")
