"""Node contention in the simulator: a step costs 1 + k x the other engines of its node
busy when it starts; engines of different nodes do not slow each other; k = 0 is the
simulator as it was without contention."""

from __future__ import annotations

import pytest

from cluster.config import WorkloadProfile
from cluster.plan.calibration import Calibration
from cluster.plan.sim import SimConfig
from cluster.plan.sim.engine import SimEngine
from cluster.plan.sim.events import EventQueue
from cluster.plan.sim.sequence import SimSeq
from cluster.plan.sim.simulator import Simulation
from tests.plan_sim_support import Finishes, at_once, calibration, poisson

LOCAL = {"default": WorkloadProfile(mode="local")}
C0, C1, C3, C4 = 0.004, 5e-5, 2e-4, 1e-6


def _contended(cal: Calibration, k: float) -> Calibration:
    return cal.model_copy(update={"step": cal.step.model_copy(update={"node_contention": k})})


def _engines(k: float, n: int, events: EventQueue, listener: Finishes, same_node: bool = True) -> list[SimEngine]:
    cal = _contended(calibration(fixed_s=C0, prefill_token_s=C1, decode_seq_s=C3, decode_context_s=C4), k)
    engines = [SimEngine(f"d{i}", "decode", cal.limits, cal.step.coefficients(), events.schedule, listener)
               for i in range(n)]
    if same_node:
        for engine in engines:
            engine.neighbours = [other for other in engines if other is not engine]
    return engines


def _alone_steps(prompt_len: int, output_len: int) -> list[float]:
    """One request decoding alone: its prefill step, then decode step j at context prompt + j."""
    return [C0 + C1 * prompt_len] + [C0 + C3 + C4 * (prompt_len + j) for j in range(1, output_len)]


def _step_times(engine: SimEngine) -> list[float]:
    ends = list(engine.step_ends)
    return [b - a for a, b in zip([0.0, *ends[:-1]], ends, strict=True)]


def test_a_busy_node_neighbour_slows_every_step_by_one_plus_k():
    prompt_len, output_len, k = 64, 200, 0.5
    events, ends = EventQueue(), Finishes()
    alone, = _engines(k, 1, events, ends)
    alone.add(SimSeq("alone", 0, prompt_len, output_len), 0.0)
    events.run(until=lambda: False)
    assert _step_times(alone) == pytest.approx(_alone_steps(prompt_len, output_len), rel=1e-9)

    events, ends = EventQueue(), Finishes()
    neighbour, engine = _engines(k, 2, events, ends)
    neighbour.add(SimSeq("long", 0, prompt_len, 4 * output_len), 0.0)  # busy until after `engine` is done
    engine.add(SimSeq("slowed", 0, prompt_len, output_len), 0.0)
    events.run(until=lambda: "slowed" in ends.finished)
    assert neighbour.busy
    assert _step_times(engine) == pytest.approx([(1 + k) * t for t in _alone_steps(prompt_len, output_len)],
                                                rel=1e-9)


def test_a_neighbour_waking_mid_run_cuts_the_run_at_the_step_in_flight():
    """Steps up to the one in flight when the neighbour wakes keep their price; the rest
    cost 1 + k times as much."""
    prompt_len, output_len, k, wake_s = 64, 60, 0.5, 0.05
    events, ends = EventQueue(), Finishes()
    neighbour, engine = _engines(k, 2, events, ends)
    engine.add(SimSeq("slowed", 0, prompt_len, output_len), 0.0)
    events.schedule(wake_s, lambda t: neighbour.add(SimSeq("late", 0, prompt_len, 4 * output_len), t))
    events.run(until=lambda: "slowed" in ends.finished)
    alone = _alone_steps(prompt_len, output_len)
    starts = [sum(alone[:i]) for i in range(len(alone))]
    in_flight = max(i for i, start in enumerate(starts) if start < wake_s)
    expected = alone[:in_flight + 1] + [(1 + k) * t for t in alone[in_flight + 1:]]
    assert 0 < in_flight < output_len - 2
    assert _step_times(engine) == pytest.approx(expected, rel=1e-9)


def test_engines_on_different_nodes_do_not_slow_each_other():
    """Two decode replicas, each given one of two simultaneous requests: on separate nodes
    both decode at the lone price; on one node at 1 + k times it."""
    prompt_len, output_len, k = 64, 100, 0.5
    cal = _contended(calibration(fixed_s=C0, prefill_token_s=C1, decode_seq_s=C3, decode_context_s=C4), k)

    def steps(replicas_per_node: int) -> dict[str, list[float]]:
        sim = Simulation(SimConfig(num_prefill=0, num_decode=2, replicas_per_node=replicas_per_node,
                                   profiles=LOCAL), cal)
        sim.run(at_once([(prompt_len, output_len)] * 2))
        assert all(engine.step == output_len for engine in sim.engines.values())  # one request each
        return {rid: _step_times(engine)[1:] for rid, engine in sim.engines.items()}  # after the first step

    alone = _alone_steps(prompt_len, output_len)[1:]
    for times in steps(replicas_per_node=1).values():
        assert times == pytest.approx(alone, rel=1e-9)
    for times in steps(replicas_per_node=2).values():
        assert times == pytest.approx([(1 + k) * t for t in alone], rel=1e-9)


def test_no_contention_gives_the_run_without_neighbours():
    """k = 0: every record and every step end as with no engine knowing its neighbours."""
    cal = calibration(fixed_s=C0, prefill_token_s=C1, decode_seq_s=C3, decode_context_s=C4)
    config = SimConfig(num_prefill=2, num_decode=4, replicas_per_node=3)
    arrivals = poisson(40.0, 300, 300, 40, seed=3)

    def run(k: float, wired: bool) -> tuple[list, list[list[float]]]:
        sim = Simulation(config, _contended(cal, k))
        assert all(len(engine.neighbours) == 2 for engine in sim.engines.values())
        if not wired:
            for engine in sim.engines.values():
                engine.neighbours = []
        result = sim.run(arrivals)
        return result.records, [list(engine.step_ends) for engine in sim.engines.values()]

    records, step_ends = run(0.0, wired=True)
    assert (records, step_ends) == run(0.0, wired=False)
    assert run(0.5, wired=True)[1] != step_ends  # the same node, contended, is slower
