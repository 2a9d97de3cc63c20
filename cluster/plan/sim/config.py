"""What one simulated run is: the cluster's shape, its routing and its limits.

`SimConfig` names the pools (`num_prefill` prefill and `num_decode` decode replicas; no
prefill replica is an all-colocated cluster), how many replicas share a node (and so its
NIC), the workload profiles the router routes by (mode, thresholds, SLO, exactly
`cluster.config.WorkloadProfile`), the router settings that shape its decisions, the
heartbeat interval, an engine-limits override, the mode every request asks for in
`x-pd-mode` (a load test's `--mode`), and the seed. Everything else comes from
the calibration.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from cluster.config import SLO, RouterSettings, WorkloadProfile
from cluster.plan.calibration import EngineLimits

_ROUTER = RouterSettings()
HEARTBEAT_INTERVAL_S = 0.5  # workers/engine_worker.py: a worker's heartbeat period


def default_profiles() -> Mapping[str, WorkloadProfile]:
    return MappingProxyType({"default": WorkloadProfile()})


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int = 1
    num_decode: int = 1
    replicas_per_node: int = 8
    profiles: Mapping[str, WorkloadProfile] = field(default_factory=default_profiles)
    default_slo: SLO = field(default_factory=SLO)  # for profiles without one (`router.default_slo`)
    forced_mode: str | None = None  # every request's `x-pd-mode`, honoured where its profile allows
    limits: EngineLimits | None = None  # None: the calibration's
    heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S
    poll_interval_s: float = _ROUTER.state_poll_interval_s  # how often the router reads the heartbeats
    offload_local_to_prefill: bool = _ROUTER.offload_local_to_prefill
    explore_fraction: float = _ROUTER.explore_fraction
    stale_after_s: float = _ROUTER.stale_after_s
    correction_half_life_s: float = _ROUTER.correction_half_life_s
    prefix_index_blocks: int = _ROUTER.prefix_index_blocks
    request_overhead_s: float | None = None  # None: the calibration's
    seed: int = 0  # the run's seed, as the arrivals were drawn with it (the simulation itself draws nothing)

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 0 or self.num_prefill + self.num_decode == 0:
            raise ValueError("SimConfig: num_prefill and num_decode must be >= 0, and not both 0")
        if self.replicas_per_node < 1:
            raise ValueError("SimConfig: replicas_per_node must be >= 1")
        if self.heartbeat_interval_s <= 0 or self.poll_interval_s <= 0:
            raise ValueError("SimConfig: heartbeat_interval_s and poll_interval_s must be > 0")
        if self.forced_mode not in (None, "auto", "threshold", "disagg", "local"):
            raise ValueError(f"SimConfig: unknown forced_mode {self.forced_mode!r}")
        if "default" not in self.profiles:
            raise ValueError("SimConfig: profiles need a 'default' entry")

    @property
    def num_replicas(self) -> int:
        return self.num_prefill + self.num_decode

    def replica_ids(self) -> list[tuple[str, str]]:
        """(replica id, role), prefill replicas first; node = position // replicas_per_node."""
        return ([(f"prefill-{i}", "prefill") for i in range(self.num_prefill)]
                + [(f"decode-{i}", "decode") for i in range(self.num_decode)])

    def slo_of(self, profile: WorkloadProfile) -> SLO:
        return profile.slo or self.default_slo
