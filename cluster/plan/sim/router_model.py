"""The router inside the simulator: the real `ClusterView`, `place()`, routing policies
and learned corrections, on the simulated clock.

Replicas heartbeat every `heartbeat_interval_s` (staggered, as independent workers do)
into a registry, as they do into the ControlPlane; the router reads the registry every
`poll_interval_s` into its `ClusterView` (`update`), and between reads the view counts
its own requests (`begin`, `prefill_done`, `end`), exactly as in production. Finished
requests feed `Corrections.observe` with the same `outcome_of` the real router learns
from, so `auto` corrects its predictions as it would live.
"""

from __future__ import annotations

import dataclasses
import time

from cluster.plan.sim.config import SimConfig
from router.cluster_view import ClusterView, ReplicaInfo
from router.corrections import Corrections
from router.learning import outcome_of
from router.placement import Placement, PolicyInputs, place
from router.policy import PLAIN
from router.profiles import Profiles, client_mode
from router.routing import PolicySettings
from workers.engine.transfer_cost import TransferCoefficients


class SimRouter:
    def __init__(self, config: SimConfig, block_size: int, max_num_seqs: int, link: TransferCoefficients) -> None:
        self.config = config
        self.view = ClusterView(block_size, max_num_seqs, config.prefix_index_blocks)
        self.corrections = Corrections(config.correction_half_life_s)
        self.settings = PolicySettings(config.explore_fraction, config.stale_after_s)
        self.profiles = Profiles(1, dict(config.profiles))
        self.registry: dict[str, ReplicaInfo] = {}
        self.transfer_model = {"*": link.to_dict()}  # what a prefill replica's heartbeat carries
        self.decision_wall_s = 0.0  # wall time spent in `place` (the real policy code)
        self.feedback_wall_s = 0.0  # ... and in the view's and the corrections' bookkeeping of outcomes
        self.num_decisions = 0

    def heartbeat(self, replica_id: str, role: str, node: int, stats: dict, now: float) -> None:
        if role == "prefill":
            stats["transfer_model"] = self.transfer_model
        self.registry[replica_id] = ReplicaInfo(replica_id, role, node_id=f"node-{node}",
                                                address=address_of(replica_id), last_heartbeat=now, stats=stats)

    def poll(self, now: float) -> None:
        self.view.update(list(self.registry.values()), now, now)

    def place(self, request_id: str, workload: str, prompt_ids: list[int], max_tokens: int, now: float) -> Placement:
        profile = self.profiles.get(self.profiles.resolve(workload))
        inputs = PolicyInputs(request_id, self.config.slo_of(profile), self.corrections.snapshot(), now,
                              self.settings)
        start = time.perf_counter()
        forced = client_mode(profile, self.config.forced_mode)
        placement = place(self.view, prompt_ids, max_tokens, profile, forced,
                          self.config.offload_local_to_prefill, PLAIN, inputs)
        self.view.begin(placement)
        self.decision_wall_s += time.perf_counter() - start
        self.num_decisions += 1
        if placement.decision.alternatives:  # a run keeps every placement: not the candidates it passed over
            placement.decision = dataclasses.replace(placement.decision, alternatives=())
        return placement

    def first_token(self, placement: Placement) -> None:
        start = time.perf_counter()
        self.view.prefill_done(placement)
        self.feedback_wall_s += time.perf_counter() - start

    def finished(self, placement: Placement, ttft_s: float, tpot_s: float | None, now: float,
                 worker_ttft_s: float | None = None, transfer_tail_s: float | None = None) -> None:
        start = time.perf_counter()
        self.view.end(placement)
        outcome = outcome_of(placement, ttft_s, tpot_s, worker_ttft_s, transfer_tail_s)
        if outcome is not None:
            self.corrections.observe(outcome, now)
        self.feedback_wall_s += time.perf_counter() - start


def address_of(replica_id: str) -> str:
    """A replica's advertised transport address (a prefill replica's transfer fits are keyed by it)."""
    return f"sim://{replica_id}"
