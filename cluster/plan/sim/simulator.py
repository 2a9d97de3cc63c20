"""`simulate(config, calibration, arrivals)`: a cluster run at engine-step granularity.

One request's path, as in production: it arrives; the router (the real placement and
policy code, router_model.py) places it on the simulated clock; after the calibrated
per-request overhead (the HTTP hop, tokenisation, the router) its prompt reaches the
engine that computes it: the decode replica (`local`, in the foreground or in the
background at the chunk the decision carries), an idle prefill replica that runs it
whole, or a prefill replica (`disagg`) whose KV then crosses the network to the decode
replica. Engines step by the real scheduler's rules (engine.py) and emit tokens at step
ends; the router sees the first token (`prefill_done`) and the end (`end`, and its
corrections learn from the outcome). Replicas heartbeat their state; the router reads
it every poll interval.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from cluster.plan.calibration import Calibration
from cluster.plan.sim.arrivals import Arrival
from cluster.plan.sim.config import SimConfig
from cluster.plan.sim.engine import SimEngine
from cluster.plan.sim.events import EventQueue
from cluster.plan.sim.network import Network
from cluster.plan.sim.node_load import NodeStreams
from cluster.plan.sim.result import SimRequest, SimResult, utilisation
from cluster.plan.sim.router_model import SimRouter, address_of
from cluster.plan.sim.sequence import SimSeq
from workers.transfer_waits import TransferWaits


def simulate(config: SimConfig, calibration: Calibration, arrivals: Sequence[Arrival],
             target_rate: float | None = None) -> SimResult:
    """Run `arrivals` through the configured cluster; deterministic for the same inputs."""
    return Simulation(config, calibration).run(arrivals, target_rate)


class Simulation:
    def __init__(self, config: SimConfig, calibration: Calibration) -> None:
        self.config = config
        self.limits = config.limits or calibration.limits
        self.overhead_s = (calibration.request_overhead_s if config.request_overhead_s is None
                           else config.request_overhead_s)
        self.events = EventQueue()
        link = calibration.transfer.coefficients()
        self.network = Network(link, self.events.schedule)
        self.router = SimRouter(config, self.limits.block_size, self.limits.max_num_seqs, link)
        coefficients = calibration.step.coefficients()
        reported = (calibration.reported_step or calibration.step).coefficients()
        self.engines: dict[str, SimEngine] = {}
        self.nodes: dict[str, int] = {}
        for i, (rid, role) in enumerate(config.replica_ids()):
            self.engines[rid] = SimEngine(rid, role, self.limits, coefficients, self.events.schedule, self,
                                          reported=reported)
            self.nodes[rid] = i // config.replicas_per_node
        self._wire_nodes()
        self.requests: list[SimRequest] = []
        self.num_done = 0
        # per prefill replica: its transfers sent and not yet arrived, as its heartbeat reports them
        self.transfer_waits = {rid: TransferWaits(lambda: self.events.now) for rid, role in config.replica_ids()
                               if role == "prefill"}

    def _wire_nodes(self) -> None:
        """Each engine learns the other engines of its node (their busy steps slow its own)
        and shares the node's decode rate with them."""
        by_node: dict[int, list[SimEngine]] = {}
        for rid, engine in self.engines.items():
            by_node.setdefault(self.nodes[rid], []).append(engine)
        streams = {node: NodeStreams() for node in by_node}
        for rid, engine in self.engines.items():
            engine.neighbours = [other for other in by_node[self.nodes[rid]] if other is not engine]
            engine.node = streams[self.nodes[rid]]

    # -- the run -------------------------------------------------------------------------------

    def run(self, arrivals: Sequence[Arrival], target_rate: float | None = None) -> SimResult:
        wall = time.perf_counter()
        start = arrivals[0].at_s if arrivals else 0.0
        self._start_heartbeats(start)
        if arrivals:
            self.events.schedule(arrivals[0].at_s, lambda t: self._arrive(arrivals, 0, t))
        total = len(arrivals)
        self.events.run(until=lambda: self.num_done >= total)
        return self._result(start, time.perf_counter() - wall, target_rate)

    def _start_heartbeats(self, start: float) -> None:
        """Every replica reports once before traffic (registered), then every interval,
        staggered across the interval; the router polls from the start."""
        interval, n = self.config.heartbeat_interval_s, len(self.engines)
        for i, engine in enumerate(self.engines.values()):
            self._heartbeat(engine, start)
            self.events.schedule(start + interval * (i + 1) / n, lambda t, e=engine: self._beat(e, t))
        self.router.poll(start)
        self.events.schedule(start + self.config.poll_interval_s, self._poll)

    def _heartbeat(self, engine: SimEngine, now: float) -> None:
        stats = engine.stats(now)
        waits = self.transfer_waits.get(engine.replica_id)
        if waits is not None:
            stats["transfer_waiting_s"] = waits.longest()
        self.router.heartbeat(engine.replica_id, engine.role, self.nodes[engine.replica_id], stats, now)

    def _beat(self, engine: SimEngine, now: float) -> None:
        self._heartbeat(engine, now)
        self.events.schedule(now + self.config.heartbeat_interval_s, lambda t: self._beat(engine, t))

    def _poll(self, now: float) -> None:
        self.router.poll(now)
        self.events.schedule(now + self.config.poll_interval_s, self._poll)

    def _arrive(self, arrivals: Sequence[Arrival], i: int, now: float) -> None:
        if i + 1 < len(arrivals):
            self.events.schedule(arrivals[i + 1].at_s, lambda t: self._arrive(arrivals, i + 1, t))
        spec = arrivals[i].spec
        prompt_ids = spec.prompt_ids
        request = SimRequest(i, spec.request_id, spec.workload, now, len(prompt_ids), spec.output_len)
        request.placement = self.router.place(spec.request_id, spec.workload, prompt_ids, spec.output_len, now)
        self.requests.append(request)
        self.events.schedule(now + self.overhead_s, lambda t: self._dispatch(request, t))

    def _dispatch(self, request: SimRequest, now: float) -> None:
        """The prompt reaches the replica that computes it."""
        request.dispatched_at = now
        placement = request.placement
        decision = placement.decision
        hashes = placement.hashes
        if decision.route == "disagg":
            decode_seq = SimSeq(request, 0, request.prompt_len, request.output_len, hashes)
            if self.engines[placement.target_replica].reserve(decode_seq):
                request.decode_seq = decode_seq
                seq = SimSeq(request, 0, request.prompt_len, 1, hashes, kv_only=True)
                self.engines[placement.prefill_replica].add(seq, now)
                return
            request.fallback = "decode-busy"  # no blocks for the KV: the decode worker prefills itself
        background = decision.yield_prefill and request.fallback is None
        seq = SimSeq(request, 0, request.prompt_len, request.output_len, hashes, background=background,
                     chunk_tokens=decision.chunk_tokens if background else None)
        engine = self.engines[placement.target_replica]
        request.token_steps = [engine.step_ends, seq.segments]
        engine.add(seq, now)

    # -- engine listener -----------------------------------------------------------------------

    def on_prefilled(self, seq: SimSeq, now: float) -> None:
        """A remote prefill is done: its KV (less the blocks the decode replica's cache
        held when it reserved) crosses the network into the reserved blocks."""
        request: SimRequest = seq.owner
        placement = request.placement
        source, target = placement.prefill_replica, placement.target_replica
        decode_seq = request.decode_seq
        cached = decode_seq.shared_blocks * self.limits.block_size
        num_bytes = (request.prompt_len - cached) * self.limits.kv_bytes_per_token
        engine = self.engines[target]
        request.token_steps = [engine.step_ends, decode_seq.segments]

        waits = self.transfer_waits[source]
        waits.computed(request.request_id, address_of(target))

        def arrived(t: float) -> None:
            waits.acknowledged(request.request_id)
            request.transfer_tail_s = t - now
            engine.cache.insert(placement.hashes)
            engine.import_kv(decode_seq, t)

        self.network.send(self.nodes[source], self.nodes[target], num_bytes, now, arrived)

    def on_first_token(self, seq: SimSeq, now: float) -> None:
        request: SimRequest = seq.owner
        if request.first_at is None:
            request.first_at = now
            self.router.first_token(request.placement)

    def on_finished(self, seq: SimSeq, now: float) -> None:
        request: SimRequest = seq.owner
        request.end_at = now
        n = request.output_len
        tpot = (now - request.first_at) / (n - 1) if n >= 2 else None
        self.router.finished(request.placement, request.first_at - request.arrival_s, tpot, now,
                             request.first_at - request.dispatched_at, request.transfer_tail_s)
        self.num_done += 1

    # -- the result ----------------------------------------------------------------------------

    def _result(self, start: float, wall_s: float, target_rate: float | None) -> SimResult:
        end = max((r.end_at for r in self.requests), default=start)
        busy: dict[str, list[float]] = {}
        for engine in self.engines.values():
            busy.setdefault(engine.role, []).append(engine.busy_s)
        return SimResult(
            records=[r.record() for r in self.requests],
            utilisation=utilisation(busy, end - start),
            duration_s=end - start,
            num_preemptions=sum(e.num_preemptions for e in self.engines.values()),
            num_steps=sum(e.step for e in self.engines.values()),
            num_events=self.events.num_events, num_transfers=self.network.num_transfers,
            wall_s=wall_s, decision_wall_s=self.router.decision_wall_s, target_rate=target_rate,
            feedback_wall_s=self.router.feedback_wall_s)
