"""The simulator against closed forms: an M/D/1 prefill queue, a decode batch at a known
step price, a link at a known bandwidth (and a NIC two transfers share); preemption when
KV blocks run out; the same run for the same seed."""

from __future__ import annotations

import pytest

from cluster.config import WorkloadProfile
from cluster.plan.sim import Arrival, SimConfig, simulate
from cluster.plan.sim.events import EventQueue
from cluster.plan.sim.network import Network
from cluster.plan.sim.simulator import Simulation
from tests.plan_sim_support import at_once, calibration, poisson, spec
from workers.engine.transfer_cost import TransferCoefficients

DISAGG = {"default": WorkloadProfile(mode="disagg")}
LOCAL = {"default": WorkloadProfile(mode="local")}


def test_a_prefill_replica_is_an_md1_queue():
    """Fixed prompts, one per step (the budget is one prompt): each prefill takes D; with
    no step cost outside prompt tokens the decode side adds nothing, so TTFT = wait + D +
    the transfer's fixed cost, the wait following Lindley's recursion request by request
    and its mean the Pollaczek-Khinchine M/D/1 value rho * D / (2 (1 - rho))."""
    prompt_len, service_s, transfer_s, rho = 256, 0.010, 0.002, 0.5
    cal = calibration(fixed_s=0.0, prefill_token_s=service_s / prompt_len, decode_seq_s=0.0,
                      transfer_fixed_s=transfer_s, bytes_per_s=None, max_num_batched_tokens=prompt_len)
    arrivals = poisson(rho / service_s, 8000, prompt_len, 1, seed=0)
    result = simulate(SimConfig(num_prefill=1, num_decode=1, profiles=DISAGG), cal, arrivals)
    assert result.routes() == {"disagg": len(arrivals)}
    waits = [r.ttft_s - service_s - transfer_s for r in result.records]
    expected, wait = [], 0.0
    for i, a in enumerate(arrivals):
        if i:
            wait = max(0.0, wait + service_s - (a.at_s - arrivals[i - 1].at_s))
        expected.append(wait)
    assert waits == pytest.approx(expected, abs=1e-9)
    mean_wait = sum(waits) / len(waits)
    assert mean_wait == pytest.approx(rho * service_s / (2 * (1 - rho)), rel=0.12)
    assert result.utilisation["prefill"] == pytest.approx(rho, rel=0.05)


def test_a_decode_batch_runs_at_the_step_price():
    """Eight requests admitted together decode together: TPOT and every ITL gap are the
    step model's price of a step of eight decodes at their context."""
    c0, c3, c4, prompt_len, output_len = 0.003, 0.0005, 1e-6, 16, 20
    cal = calibration(fixed_s=c0, prefill_token_s=1e-5, decode_seq_s=c3, decode_context_s=c4)
    result = simulate(SimConfig(num_prefill=0, num_decode=1, profiles=LOCAL), cal,
                      at_once([(prompt_len, output_len)] * 8))
    # step 0 prefills all eight; decode step j attends every sequence's context end, prompt + j
    steps = [c0 + 8 * c3 + c4 * 8 * (prompt_len + j) for j in range(1, output_len)]
    for r in result.records:
        assert r.itl_s == pytest.approx(steps, rel=1e-9)
        assert r.tpot_s == pytest.approx(sum(steps) / len(steps), rel=1e-9)
    assert result.summary().tpot_ms["p50"] == pytest.approx(1000 * sum(steps) / len(steps), rel=1e-6)


def _transfer_times(sends: list[tuple[int, int, float]], fixed_s: float, bytes_per_s: float) -> list[float]:
    events = EventQueue()
    network = Network(TransferCoefficients(fixed_s, bytes_per_s), events.schedule)
    done: dict[int, float] = {}
    for i, (src, dst, num_bytes) in enumerate(sends):
        network.send(src, dst, num_bytes, 0.0, lambda t, i=i: done.__setitem__(i, t))
    events.run(until=lambda: len(done) == len(sends))
    return [done[i] for i in range(len(sends))]


def test_a_link_takes_fixed_plus_bytes_over_bandwidth_and_a_shared_nic_halves_it():
    fixed, bandwidth, size = 0.002, 1e8, 4e6
    alone = fixed + size / bandwidth
    assert _transfer_times([(0, 1, size)], fixed, bandwidth) == pytest.approx([alone])
    # two transfers out of one node share its NIC: each moves at half the bandwidth
    assert _transfer_times([(0, 1, size), (0, 2, size)], fixed, bandwidth) == pytest.approx(
        [fixed + 2 * size / bandwidth] * 2)
    # into one node likewise; between disjoint nodes they do not interfere
    assert _transfer_times([(0, 2, size), (1, 2, size)], fixed, bandwidth) == pytest.approx(
        [fixed + 2 * size / bandwidth] * 2)
    assert _transfer_times([(0, 1, size), (2, 3, size)], fixed, bandwidth) == pytest.approx([alone, alone])
    # a short transfer finishes first; the long one gets the whole link back
    short, long = _transfer_times([(0, 1, size / 2), (0, 1, size)], fixed, bandwidth)
    assert short == pytest.approx(fixed + size / bandwidth)
    assert long == pytest.approx(fixed + 1.5 * size / bandwidth)


def test_a_disaggregated_request_pays_its_kv_transfer():
    """One request alone: TTFT = prefill step + fixed + bytes / bandwidth + the decode step."""
    prompt_len, kv_bytes, bandwidth, fixed = 512, 4096, 5e8, 0.003
    cal = calibration(fixed_s=0.002, prefill_token_s=2e-5, decode_seq_s=1e-4, transfer_fixed_s=fixed,
                      bytes_per_s=bandwidth, kv_bytes_per_token=kv_bytes)
    result = simulate(SimConfig(num_prefill=1, num_decode=1, profiles=DISAGG), cal, at_once([(prompt_len, 2)]))
    expected = (0.002 + 2e-5 * prompt_len) + fixed + prompt_len * kv_bytes / bandwidth + (0.002 + 1e-4)
    assert result.records[0].ttft_s == pytest.approx(expected, rel=1e-9)
    assert result.num_transfers == 1


def test_sequences_are_preempted_and_recomputed_when_kv_blocks_run_out():
    """Twelve long answers on a pool that holds about four: the scheduler preempts, every
    request still completes with all its tokens."""
    cal = calibration(num_kv_blocks=64, block_size=16, max_num_seqs=16)
    result = simulate(SimConfig(num_prefill=0, num_decode=1, profiles=LOCAL), cal, at_once([(100, 150)] * 12))
    assert result.num_preemptions > 0
    for r in result.records:
        assert r.ok and len(r.itl_s) + 1 == r.completion_tokens == 150
        assert all(gap >= 0 for gap in r.itl_s)


def test_the_same_seed_gives_the_same_run():
    cal = calibration()
    config = SimConfig(num_prefill=1, num_decode=2, profiles={"default": WorkloadProfile(mode="auto")})
    runs = [simulate(config, cal, poisson(40.0, 300, 300, 20, seed=3)) for _ in range(2)]
    first, second = ([(r.route, r.reason, r.ttft_s, r.e2e_s) for r in run.records] for run in runs)
    assert first == second
    other = simulate(config, cal, poisson(40.0, 300, 300, 20, seed=4))
    assert [r.ttft_s for r in other.records] != [r[2] for r in first]


def test_a_decode_replica_without_blocks_for_the_kv_prefills_itself():
    """The decode worker reserves the KV's blocks before the remote prefill; with none
    free it prefills locally (`decode-busy`, as workers/decode.py falls back)."""
    cal = calibration(num_kv_blocks=40, block_size=16)
    sim = Simulation(SimConfig(num_prefill=1, num_decode=1, profiles=DISAGG), cal)
    result = sim.run(at_once([(300, 100)] * 3))
    assert [(r.route, r.reason) for r in result.records] == [
        ("disagg", "profile"), ("disagg", "profile"), ("local", "decode-busy")]
    assert result.num_transfers == 2
    assert all(len(r.itl_s) == 99 for r in result.records)


def test_kv_the_decode_replica_caches_is_not_sent():
    """The second prompt shares 20 full blocks with the first, which the decode replica
    holds: only the rest of its KV crosses the network."""
    kv_bytes, prefix = 1000, "p" * 320
    cal = calibration(kv_bytes_per_token=kv_bytes)
    sim = Simulation(SimConfig(num_prefill=1, num_decode=1, profiles=DISAGG), cal)
    arrivals = [Arrival(0.0, spec(0, 400, 4, shared_prefix=prefix)), Arrival(1.0, spec(1, 400, 4, shared_prefix=prefix))]
    sim.run(arrivals)
    assert sim.network.bytes_sent == 400 * kv_bytes + (400 - 320) * kv_bytes


def test_a_prefill_replica_reports_its_transfer_waiting_as_a_real_one_does():
    """Its heartbeats carry how long the KV of a computed prompt has been on its way (the
    router prices that link by it, as from a real prefill replica), and nothing once it
    arrived."""
    cal = calibration(fixed_s=0.002, prefill_token_s=2e-5, decode_seq_s=1e-4, transfer_fixed_s=0.003,
                      bytes_per_s=512 * 4096 / 2.0, kv_bytes_per_token=4096)  # the KV takes 2 s
    sim = Simulation(SimConfig(num_prefill=1, num_decode=1, profiles=DISAGG), cal)
    beats: list[dict] = []
    heartbeat = sim.router.heartbeat
    sim.router.heartbeat = lambda rid, role, node, stats, now: (
        beats.append(stats["transfer_waiting_s"]) if role == "prefill" else None,
        heartbeat(rid, role, node, stats, now))
    sim.run(at_once([(512, 2)]), None)
    waits = [max(b.values()) for b in beats if b]
    assert waits and 1.0 < max(waits) <= 2.01, beats
    assert all(w.longest() == {} for w in sim.transfer_waits.values())  # arrived: none waits
