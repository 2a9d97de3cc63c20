"""The step model's stream term: a node's decode rate read from all of its replicas'
records, the fit that recovers how much it stretches a step, and the simulator that
prices a step by its node's rate the same way."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.config import WorkloadProfile
from cluster.plan.fit import fit_steps
from cluster.plan.records import ReplicaStep, node_of_replicas, with_node_rates
from cluster.plan.sim import SimConfig
from cluster.plan.sim.engine import SimEngine
from cluster.plan.sim.events import EventQueue
from cluster.plan.sim.node_load import NodeStreams
from cluster.plan.sim.sequence import SimSeq
from cluster.plan.sim.simulator import Simulation
from tests.plan_sim_support import Finishes, at_once, calibration
from workers.engine.cost_model import StepFeatures, predict_step_s
from workers.engine.step_cost import StepRecord

TRUE = (0.002, 4e-6, 0.0, 5e-5, 3e-7)  # c0..c4
GAMMA = 1e-3  # stretch per decode sequence-step a second


def _decode(at: float, seqs: int, wall: float = 0.002, cpu: float = 0.0) -> StepRecord:
    return StepRecord(start_time=at, step_time_s=wall, num_prefill_tokens=0, num_decode_seqs=seqs,
                      num_context_tokens=seqs * 100, num_running=seqs, num_waiting=0, cpu_time_s=cpu)


def test_a_steps_node_rate_counts_every_replica_of_its_node_over_the_window_before_it():
    steps = [ReplicaStep("a", "decode", _decode(t, 4)) for t in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.2)]
    steps += [ReplicaStep("b", "decode", _decode(t, 10)) for t in (0.1, 0.5, 0.9)]
    rated = {(s.replica_id, s.record.start_time): s.node_decode_rate for s in with_node_rates(steps, window_s=1.0)}
    assert rated[("a", 0.0)] == 0.0  # nothing started before it
    assert rated[("b", 0.1)] == 4.0  # a@0.0
    assert rated[("a", 1.0)] == pytest.approx(4 * 5 + 10 * 3)  # a@0.0..0.8 and b@0.1,0.5,0.9 (0.0 is in [0, 1))
    assert rated[("a", 1.2)] == pytest.approx(4 * 5 + 10 * 2)  # from 0.2 on: a@0.2..1.0, b@0.5,0.9
    apart = with_node_rates(steps, nodes={"a": "n1", "b": "n2"}, window_s=1.0)
    assert {s.record.start_time: s.node_decode_rate for s in apart if s.replica_id == "a"}[1.2] == 4 * 5
    assert [s.record for s in apart] == [s.record for s in steps]  # the records themselves untouched


def test_replicas_name_their_node_where_the_deployment_says():
    deployment = {"replicas": {"a": {"role": "decode", "node_id": "n1"}, "b": {"role": "prefill"}}}
    assert node_of_replicas(deployment) == {"a": "n1"}
    assert node_of_replicas({}) == {}


def _loaded_steps(n: int, seed: int = 0) -> list[ReplicaStep]:
    """Steps of random work whose CPU time is the model's at TRUE and whose wall time that
    stretched by 1 + GAMMA x their node's decode rate."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prefill = rng.choice([0, rng.randrange(1, 512)])
        seqs = rng.randrange(1, 48)
        context = seqs * rng.randrange(50, 1000)
        features = StepFeatures(float(prefill), float(prefill * prefill), float(seqs), float(context))
        cpu = float(features.row() @ np.array(TRUE))
        rate = rng.uniform(0.0, 800.0)
        record = StepRecord(start_time=float(i), step_time_s=cpu * (1.0 + GAMMA * rate), num_prefill_tokens=prefill,
                            num_decode_seqs=seqs, num_context_tokens=context + prefill,
                            num_running=seqs + (1 if prefill else 0), num_waiting=0, num_prefill_seqs=1 if prefill else 0, prefill_attention_work=prefill * prefill,
                            cpu_time_s=cpu)
        out.append(ReplicaStep("d0", "decode", record, node_decode_rate=rate))
    return out


def test_the_fit_recovers_the_work_and_how_the_nodes_streams_stretch_it():
    c = fit_steps(_loaded_steps(600))
    assert c.node_stream_contention == pytest.approx(GAMMA, rel=0.02)
    assert np.allclose(c.vector(), TRUE, rtol=0.02, atol=1e-9), c
    step = _loaded_steps(1, seed=7)[0]
    features = StepFeatures(float(step.record.num_prefill_tokens), float(step.record.prefill_attention_work),
                            float(step.record.num_decode_seqs),
                            float(step.record.num_context_tokens - step.record.num_prefill_tokens),
                            node_decode_rate=step.node_decode_rate)
    assert predict_step_s(c, features) == pytest.approx(step.record.step_time_s, rel=0.02)


def test_without_a_node_rate_the_stream_term_stays_zero():
    steps = [ReplicaStep(s.replica_id, s.role, s.record) for s in _loaded_steps(300)]  # rates unknown: 0
    assert fit_steps(steps).node_stream_contention == 0.0


def test_the_node_rate_is_the_decode_steps_of_the_last_window():
    node = NodeStreams(window_s=1.0)
    node.add(0.0, 300)
    node.add(0.5, 100)
    assert node.rate(0.9) == 400.0
    assert node.rate(1.2) == 100.0  # the first entry left the window
    assert node.rate(2.0) == 0.0


C0, C1, C3, C4 = 0.004, 5e-5, 2e-4, 1e-6


def test_a_simulated_step_is_stretched_by_its_nodes_rate():
    cal = calibration(fixed_s=C0, prefill_token_s=C1, decode_seq_s=C3, decode_context_s=C4)
    streamed = cal.step.model_copy(update={"node_stream_contention": GAMMA}).coefficients()
    for gamma_on, expected in ((True, 1.0 + GAMMA * 400), (False, 1.0)):
        events, ends = EventQueue(), Finishes()
        engine = SimEngine("d0", "decode", cal.limits, streamed if gamma_on else cal.step.coefficients(),
                           events.schedule, ends)
        engine.node.add(0.0, 400)  # the node streamed 400 sequence-steps in the last second
        engine.add(SimSeq("r", 0, 64, 3), 0.0)
        events.run(until=lambda done=ends: "r" in done.finished)
        assert engine.step_ends[0] == pytest.approx((C0 + C1 * 64) * expected, rel=1e-9)


def test_each_node_keeps_its_own_rate():
    cal = calibration(fixed_s=C0, prefill_token_s=C1, decode_seq_s=C3, decode_context_s=C4)
    cal = cal.model_copy(update={"step": cal.step.model_copy(update={"node_stream_contention": GAMMA})})
    local = {"default": WorkloadProfile(mode="local")}

    def run(replicas_per_node: int) -> tuple[Simulation, list[float]]:
        sim = Simulation(SimConfig(num_prefill=0, num_decode=2, replicas_per_node=replicas_per_node,
                                   profiles=local), cal)
        sim.run(at_once([(64, 200)] * 2))
        return sim, [engine.step_ends[-1] for engine in sim.engines.values()]

    apart, apart_ends = run(1)
    together, together_ends = run(2)
    a, b = apart.engines.values()
    assert a.node is not b.node
    c, d = together.engines.values()
    assert c.node is d.node
    assert min(together_ends) > max(apart_ends)  # twice the streams on one node: every step stretched more


def test_a_live_answer_rates_each_named_node_apart():
    from cluster.plan.records import from_admin_answer

    def rows(times):
        return [{**_decode(t, 5).__dict__} for t in times]

    answer = {"replicas": {"a": {"role": "decode", "node_id": "n1", "steps": rows([0.0, 0.5])},
                           "b": {"role": "decode", "node_id": "n2", "steps": rows([0.1, 0.6])}}}
    records = from_admin_answer(answer)
    assert records.deployment["replicas"]["a"]["node_id"] == "n1"
    assert {(s.replica_id, s.record.start_time): s.node_decode_rate for s in records.steps} == {
        ("a", 0.0): 0.0, ("a", 0.5): 5.0, ("b", 0.1): 0.0, ("b", 0.6): 5.0}
