"""`pdcluster bench policy`: how long the router takes to decide where one request runs.

No Ray, no engine: one `ClusterView` of `num_replicas` replicas (half prefill, half decode
by default) whose heartbeats carry what real ones do — a fitted step model per replica,
random queues and streams, KV sizes and, on prefill replicas, transfer models keyed by
every decode replica's address — refreshed every half second of simulated time (200
requests/s arrive). Each request (prompts of 16..4096 tokens, log-uniform; some extend a
shared system prompt or an earlier conversation, so the prefix index has hits; some
n > 1, prompt logprobs or a grammar) is placed, begun in the view, gets its first token
and ends some requests later, and its outcome (the prediction times a per-replica bias
and noise) feeds the router's `Corrections`, seeded beforehand for every replica.
The requests and heartbeats are made in cluster/bench/policy_cluster.py.

Only `place()` is timed (`time.perf_counter_ns`): choosing the decode replica over the
prefix index, pricing every candidate and deciding. Its thread CPU time is reported too:
on a shared machine the wall-clock tail holds the time other processes took the core.
Taking in each poll's heartbeats (`ClusterView.update`, which parses them) is not part
of a decision; its time is reported apart (`heartbeat_update_p50_ms`). After each
decision a fixed piece of work is timed too (cluster/bench/speed_probe.py): its p99 /
p50 is how much of the decisions' tail the machine alone makes.
The same requests and heartbeats run in mode `auto` and, for comparison, `threshold`.
"""

from __future__ import annotations

import heapq
import math
import os
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from cluster.bench.policy_cluster import MAX_PROMPT_LEN, Heartbeats, Workload
from cluster.bench.speed_probe import probe_ns
from cluster.config import RouterSettings, WorkloadProfile
from router import gc_tuning
from router.cluster_view import ClusterView
from router.corrections import Corrections, Outcome
from router.learning import outcome_of
from router.placement import Placement, PolicyInputs, place

Log = Callable[[str], None]
MODES = ("auto", "threshold")
TARGET_P99_MS = 1.0  # auto, at 64 replicas
REQUEST_RATE = 200.0  # arrivals per simulated second
HEARTBEAT_S = 0.5


@dataclass(frozen=True)
class PolicyBenchConfig:
    num_replicas: int = 64
    num_prefill: int | None = None  # None: half of them
    num_decisions: int = 5000  # timed, per mode
    num_warmup: int = 500  # untimed, per mode, after the corrections are seeded
    seed: int = 0
    block_size: int = 16
    max_num_seqs: int = 64
    # the router's collector setting (`router.gc_gen0_threshold`); None: Python's defaults
    gc_gen0_threshold: int | None = RouterSettings().gc_gen0_threshold

    @property
    def prefill_count(self) -> int:
        return self.num_replicas // 2 if self.num_prefill is None else self.num_prefill


def run_benchmark(cfg: PolicyBenchConfig, log: Log = lambda _msg: None) -> dict:
    started, load_start = time.perf_counter(), os.getloadavg()
    results = {}
    with gc_tuning.tuned(cfg.gc_gen0_threshold) as gc_thresholds:
        for mode in MODES:
            results[mode] = run_mode(cfg, mode)
            _log_mode(log, mode, results[mode])
    p99 = results["auto"]["p99_ms"]
    return {"bench": "policy", "results": results,
            "targets": {"auto_place_p99_ms": {"value": p99, "limit": TARGET_P99_MS, "met": p99 < TARGET_P99_MS}},
            "setup": {**asdict(cfg), "num_prefill": cfg.prefill_count, "num_decode": cfg.num_replicas - cfg.prefill_count,
                      "request_rate": REQUEST_RATE, "heartbeat_s": HEARTBEAT_S, "max_prompt_len": MAX_PROMPT_LEN,
                      "gc_thresholds": list(gc_thresholds)},
            "machine": {"cores": os.cpu_count(), "loadavg_start": [round(x, 2) for x in load_start],
                        "loadavg_end": [round(x, 2) for x in os.getloadavg()]},
            "run_time_s": round(time.perf_counter() - started, 1)}


def _log_mode(log: Log, mode: str, r: dict) -> None:
    log(f"{mode:9s} p50 {r['p50_ms']:.3f} ms  p99 {r['p99_ms']:.3f} ms  max {r['max_ms']:.3f} ms  "
        f"(CPU p99 {r['cpu_p99_ms']:.3f} ms)  {r['decisions_per_s']:,.0f} decisions/s  routes {r['routes']}  "
        f"heartbeats taken in p50 {r.get('heartbeat_update_p50_ms', 0.0):.2f} ms  "
        f"machine p99/p50 {r.get('machine_probe_p99_over_p50', 0.0):.2f}")


def run_mode(cfg: PolicyBenchConfig, mode: str) -> dict:
    """One mode over the seeded requests and heartbeats: the figures of the timed decisions."""
    sim = Simulation(cfg, WorkloadProfile(mode=mode))
    sim.seed_corrections()
    for _ in range(cfg.num_warmup):
        sim.decide()
    times_ns, cpu_ns, probe_times_ns, mix = [], [], [], Mix()
    for _ in range(cfg.num_decisions):
        placement, ns, cpu = sim.decide()
        times_ns.append(ns)
        cpu_ns.append(cpu)
        probe_times_ns.append(probe_ns())
        mix.count(placement)  # not kept: a heap of old placements would slow the garbage collector
    return {**summary(times_ns, cpu_ns, mix), **heartbeat_summary(sim.update_ns), **machine_spread(probe_times_ns)}


@dataclass
class Mix:
    """What the timed decisions chose."""

    routes: Counter = field(default_factory=Counter)
    kinds: Counter = field(default_factory=Counter)
    reasons: Counter = field(default_factory=Counter)
    num_prefix_hits: int = 0

    def count(self, placement: Placement) -> None:
        d = placement.decision
        self.routes[d.route] += 1
        self.kinds[d.candidate.kind if d.candidate else "none"] += 1
        self.reasons[d.reason] += 1
        self.num_prefix_hits += placement.num_cached_tokens > 0


def summary(times_ns: list[int], cpu_ns: list[int], mix: Mix) -> dict:
    ms, cpu_ms = sorted(t / 1e6 for t in times_ns), sorted(t / 1e6 for t in cpu_ns)
    return {"num_decisions": len(ms), "p50_ms": round(_quantile(ms, 0.5), 4), "p99_ms": round(_quantile(ms, 0.99), 4),
            "max_ms": round(ms[-1], 4), "mean_ms": round(statistics.fmean(ms), 4),
            "decisions_per_s": round(len(ms) / (sum(times_ns) / 1e9), 1),
            "cpu_p50_ms": round(_quantile(cpu_ms, 0.5), 4), "cpu_p99_ms": round(_quantile(cpu_ms, 0.99), 4),
            "routes": dict(mix.routes.most_common()), "kinds": dict(mix.kinds.most_common()),
            "reasons": dict(mix.reasons.most_common()), "prefix_hit_fraction": round(mix.num_prefix_hits / len(ms), 3)}


def heartbeat_summary(update_ns: list[int]) -> dict:
    """What taking in one poll's heartbeats cost (`ClusterView.update`, off the decision:
    each heartbeat is parsed there, once)."""
    ms = sorted(t / 1e6 for t in update_ns)
    if not ms:
        return {"num_heartbeats": 0}
    return {"num_heartbeats": len(ms), "heartbeat_update_p50_ms": round(_quantile(ms, 0.5), 4),
            "heartbeat_update_max_ms": round(ms[-1], 4)}


def machine_spread(probe_times_ns: list[int]) -> dict:
    """The fixed work's median time and its p99 / p50 (cluster/bench/speed_probe.py):
    how far the machine alone stretched the same work while the decisions ran."""
    ms = sorted(t / 1e6 for t in probe_times_ns)
    if not ms:
        return {}
    p50 = _quantile(ms, 0.5)
    return {"machine_probe_p50_ms": round(p50, 4), "machine_probe_p99_over_p50": round(_quantile(ms, 0.99) / p50, 3)}


def _quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, math.ceil(q * len(sorted_values)) - 1)]


class Simulation:
    """The view, the corrections and the requests in flight of one router replica.

    Three seeded streams, so both modes see the same requests and heartbeats whatever
    they decide: `requests`, `heartbeats`, and `outcomes` (lifetimes, measurements)."""

    def __init__(self, cfg: PolicyBenchConfig, profile: WorkloadProfile) -> None:
        self.cfg, self.profile = cfg, profile
        self.requests = Workload(cfg.seed)
        self.heartbeats = Heartbeats(cfg.num_replicas, cfg.prefill_count, cfg.max_num_seqs, cfg.seed + 1)
        self.outcomes = random.Random(cfg.seed + 2)
        self.view = ClusterView(cfg.block_size, cfg.max_num_seqs)
        self.view.update(self.heartbeats.next(0.0), 0.0, 0.0)
        self.corrections = Corrections()
        self.now, self.next_heartbeat, self.num_decided = 0.0, HEARTBEAT_S, 0
        self.update_ns: list[int] = []  # each poll's `view.update`, timed (not part of a decision)
        self.pending: list[tuple[int, int, str, Placement]] = []  # (due decision, tiebreak, event, placement)
        # how much slower than predicted each replica really is (what the corrections learn)
        self.bias = {r.replica_id: math.exp(self.outcomes.gauss(0.0, 0.3)) for r in self.view.replicas.values()}

    def seed_corrections(self) -> None:
        """A few measured requests per replica and route, as after minutes of traffic."""
        replicas = list(self.view.replicas.values())
        decodes = [r.replica_id for r in replicas if r.role == "decode"]
        for _ in range(4):
            for r in replicas:
                decode = r.replica_id if r.role == "decode" else self.outcomes.choice(decodes)
                for route in ("local", "disagg") if r.role == "prefill" else ("local",):
                    self._observe(Outcome(route, r.replica_id, decode, 0.2, 0.0, 0.03, 0.0))

    def decide(self) -> tuple[Placement, int, int]:
        """Place the next request (timed: wall and thread CPU ns), begin it, then advance
        the clock and the events."""
        req = self.requests.next()
        inputs = PolicyInputs(req.request_id, req.slo, self.corrections.snapshot(), self.now)
        cpu_start = time.thread_time_ns()
        start = time.perf_counter_ns()
        placement = place(self.view, req.prompt_ids, req.max_tokens, self.profile, None, True, req.work, inputs)
        elapsed = time.perf_counter_ns() - start
        cpu = time.thread_time_ns() - cpu_start
        self.view.begin(placement)
        self._schedule(placement)
        self._advance()
        return placement, elapsed, cpu

    def _schedule(self, placement: Placement) -> None:
        first = self.num_decided + self.outcomes.randint(1, 40)
        last = first + self.outcomes.randint(1, 400)
        heapq.heappush(self.pending, (first, self.num_decided, "first", placement))
        heapq.heappush(self.pending, (last, self.num_decided, "end", placement))

    def _advance(self) -> None:
        self.num_decided += 1
        self.now += self.outcomes.expovariate(REQUEST_RATE)
        while self.pending and self.pending[0][0] <= self.num_decided:
            _, _, event, placement = heapq.heappop(self.pending)
            if event == "first":
                # with the clock: each stream's TPOT allowance is priced from its progress
                self.view.prefill_done(placement, self.now, placement.num_sequences)
            else:
                self.view.end(placement)
                self._learn(placement)
        if self.now >= self.next_heartbeat:
            replicas = self.heartbeats.next(self.now)
            start = time.perf_counter_ns()
            self.view.update(replicas, self.now, self.now)  # they age till the next, as live
            self.update_ns.append(time.perf_counter_ns() - start)
            self.next_heartbeat += HEARTBEAT_S

    def _learn(self, placement: Placement) -> None:
        prediction = placement.decision.candidate.prediction if placement.decision.candidate else None
        if prediction is None:
            return
        outcome = outcome_of(placement, prediction.ttft_s, prediction.tpot_s)
        if outcome is not None:
            self._observe(outcome)

    def _observe(self, outcome: Outcome) -> None:
        """`outcome` measured as its prediction times the replicas' bias and some noise."""
        def measured(predicted: float, replica: str) -> float:
            return predicted * self.bias[replica] * math.exp(self.outcomes.gauss(0.0, 0.2))

        tpot = outcome.predicted_tpot_s
        self.corrections.observe(Outcome(
            outcome.route, outcome.prefill_replica, outcome.decode_replica, outcome.predicted_ttft_s,
            measured(outcome.predicted_ttft_s, outcome.prefill_replica), tpot,
            measured(tpot, outcome.decode_replica) if tpot is not None else None,
            learned_as=outcome.learned_as), self.now)
