"""The cluster's shared state: workload profiles, the replica registry and metrics.

`ControlPlaneCore` is the logic as a plain class (tests drive it directly with a fake
clock); `ControlPlane` is the one-replica Serve deployment around it.

Workers call `register(...)` when they start and `heartbeat(...)` every ~0.5 s with
their stats and metrics snapshot. Routers poll `get_state(since_version)` every ~0.5 s,
so a profile change reaches every router replica within about a second, and a restarted
router gets the current profiles on its first poll. Profiles change through the admin
API (`set_profile`, `delete_profile`) and through a Serve redeploy
(`reconfigure(user_config)`), each bumping `version`. `version` is one counter for all
profiles: a write given an `expected_version` happens only if nothing changed since the
writer read that version (the compare and the write are one step here, so racing router
replicas cannot both win).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ray import serve

from cluster.config import WorkloadProfile
from router import metrics
from router.cluster_view import ReplicaInfo

FORGET_AFTER_S = 60.0  # a silent replica is dropped from the registry after this


class ProfileChangeRefused(Exception):
    """A profile write that did not happen; nothing changed. `current_version`: the version
    the profiles are still at."""

    def __init__(self, workload: str, current_version: int) -> None:
        super().__init__(workload, current_version)  # the args that pickle carries across Ray
        self.workload = workload
        self.current_version = current_version


class VersionConflict(ProfileChangeRefused):
    """The writer's expected version is not the current one: profiles changed since its read."""


class UnknownWorkload(ProfileChangeRefused):
    """No profile of that name to delete."""


class DefaultWorkloadRequired(ProfileChangeRefused):
    """`default` always exists (an unknown workload resolves to it), so it cannot be deleted."""


@dataclass
class ClusterState:
    """What a router polls: profiles only when they changed since the router's version."""

    version: int
    profiles: dict[str, dict] | None
    replicas: list[ReplicaInfo]
    time: float


class ControlPlaneCore:
    def __init__(self, workloads: dict[str, Any], heartbeat_timeout_s: float = 3.0,
                 clock: Callable[[], float] = time.time) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock
        # Serve runs sync methods on a thread pool: a version check and its write, and a
        # read of (version, profiles), each hold this lock so they are one step.
        self.profiles_lock = threading.Lock()
        self.version = 0
        self.profiles: dict[str, WorkloadProfile] = {}  # replaced whole on a change, never mutated
        self.replicas: dict[str, ReplicaInfo] = {}
        self.snapshots: dict[str, tuple[float, metrics.Snapshot]] = {}
        self.retired: metrics.Snapshot = []  # counters of forgotten sources, so sums never drop
        self.replace_profiles(workloads)

    # Profiles.
    def replace_profiles(self, workloads: dict[str, Any]) -> int:
        profiles = {name: WorkloadProfile.model_validate(p) for name, p in workloads.items()}
        profiles.setdefault("default", WorkloadProfile())
        with self.profiles_lock:
            return self._write(profiles)

    def set_profile(self, name: str, profile: dict[str, Any], expected_version: int | None = None) -> int:
        """Add or replace one profile; the new version. Raises `VersionConflict` when
        `expected_version` is given and is not the current version."""
        with self.profiles_lock:
            self._check_version(name, expected_version)
            return self._write({**self.profiles, name: WorkloadProfile.model_validate(profile)})

    def delete_profile(self, name: str, expected_version: int | None = None) -> int:
        """Remove one profile; the new version. Raises `DefaultWorkloadRequired` for
        `default`, then `VersionConflict` as `set_profile` does, then `UnknownWorkload`
        (a stale writer learns it is stale before it learns the name is gone)."""
        with self.profiles_lock:
            if name == "default":
                raise DefaultWorkloadRequired(name, self.version)
            self._check_version(name, expected_version)
            if name not in self.profiles:
                raise UnknownWorkload(name, self.version)
            return self._write({n: p for n, p in self.profiles.items() if n != name})

    def get_profiles(self) -> tuple[int, dict[str, dict]]:
        version, profiles = self._read()
        return version, _dump(profiles)

    def _read(self) -> tuple[int, dict[str, WorkloadProfile]]:
        """The version and the profiles it names, read together."""
        with self.profiles_lock:
            return self.version, self.profiles

    def _check_version(self, name: str, expected_version: int | None) -> None:
        if expected_version is not None and expected_version != self.version:
            raise VersionConflict(name, self.version)

    def _write(self, profiles: dict[str, WorkloadProfile]) -> int:
        """Install new profiles under a new version (the caller holds the lock)."""
        self.profiles = profiles
        self.version += 1
        return self.version

    # Replicas.
    def register(self, replica_id: str, role: str, node_id: str = "", address: str | None = None,
                 stats: dict[str, Any] | None = None, **extra: Any) -> None:
        """`extra` (e.g. `layout_fingerprint`) is kept in `ReplicaInfo.extra`."""
        assert role in ("prefill", "decode"), role
        self.replicas[replica_id] = ReplicaInfo(replica_id, role, node_id, address, True,
                                                self.clock(), dict(stats or {}), dict(extra))

    def heartbeat(self, replica_id: str, stats: dict[str, Any],
                  metrics_snapshot: metrics.Snapshot | str | bytes | None = None) -> bool:
        """False when the replica is unknown (e.g. the ControlPlane restarted): re-register.
        `metrics_snapshot` is `metrics.snapshot(...)` output or Prometheus text."""
        now = self.clock()
        if metrics_snapshot is not None:
            self.snapshots[replica_id] = (now, metrics.as_snapshot(metrics_snapshot))
        info = self.replicas.get(replica_id)
        if info is None:
            return False
        info.last_heartbeat = now
        info.stats = dict(stats)
        info.healthy = bool(stats.get("healthy", True))
        return True

    def deregister(self, replica_id: str) -> None:
        self.replicas.pop(replica_id, None)
        self._retire(replica_id)

    def live_replicas(self) -> list[ReplicaInfo]:
        """Every registered replica, `healthy` false when its heartbeat is overdue."""
        now = self.clock()
        self._forget_silent(now)
        fresh = now - self.heartbeat_timeout_s
        return [replace(r, healthy=r.healthy and r.last_heartbeat >= fresh, stats=dict(r.stats))
                for r in self.replicas.values()]

    def get_state(self, since_version: int | None = None) -> ClusterState:
        version, profiles = self._read()  # together: a poller never pairs a version with other profiles
        return ClusterState(version, None if since_version == version else _dump(profiles),
                            self.live_replicas(), self.clock())

    # Metrics.
    def push_metrics(self, source_id: str, snapshot: metrics.Snapshot | str | bytes) -> None:
        self.snapshots[source_id] = (self.clock(), metrics.as_snapshot(snapshot))

    def now(self) -> float:
        """This control plane's clock, the one `stale_sources` compares against."""
        return self.clock()

    def stale_sources(self, since: float) -> list[str]:
        """The sources (replicas, routers) whose latest metrics were pushed before `since`."""
        self._forget_silent(self.clock())
        return sorted(s for s, (t, _) in self.snapshots.items() if t < since)

    def render_metrics(self) -> bytes:
        self._forget_silent(self.clock())
        current = [snap for _, snap in self.snapshots.values()]
        return metrics.render(metrics.merge([self.retired, *current]))

    def _forget_silent(self, now: float) -> None:
        cutoff = now - FORGET_AFTER_S
        for replica_id in [r for r, info in self.replicas.items() if info.last_heartbeat < cutoff]:
            self.deregister(replica_id)
        for source_id in [s for s, (t, _) in self.snapshots.items() if t < cutoff]:
            self._retire(source_id)

    def _retire(self, source_id: str) -> None:
        entry = self.snapshots.pop(source_id, None)
        if entry is not None:
            cumulative = [f for f in entry[1] if f["type"] != "gauge"]
            self.retired = metrics.merge([self.retired, cumulative])


def _dump(profiles: dict[str, WorkloadProfile]) -> dict[str, dict]:
    return {name: p.model_dump() for name, p in profiles.items()}


@serve.deployment(name="ControlPlane", num_replicas=1, max_ongoing_requests=1000,
                  ray_actor_options={"num_cpus": 0})
class ControlPlane:
    """One replica; every method is fast and never awaits anything."""

    def __init__(self, workloads: dict[str, Any] | None = None, heartbeat_timeout_s: float = 3.0) -> None:
        self.core = ControlPlaneCore(workloads or {}, heartbeat_timeout_s)

    def reconfigure(self, user_config: dict[str, Any]) -> None:
        if user_config and "workloads" in user_config:
            self.core.replace_profiles(user_config["workloads"])

    def register(self, replica_id: str, role: str, node_id: str = "", address: str | None = None,
                 stats: dict[str, Any] | None = None, **extra: Any) -> None:
        self.core.register(replica_id, role, node_id, address, stats, **extra)

    def heartbeat(self, replica_id: str, stats: dict[str, Any],
                  metrics_snapshot: metrics.Snapshot | str | None = None) -> bool:
        return self.core.heartbeat(replica_id, stats, metrics_snapshot)

    def deregister(self, replica_id: str) -> None:
        self.core.deregister(replica_id)

    def get_state(self, since_version: int | None = None) -> ClusterState:
        return self.core.get_state(since_version)

    def get_profiles(self) -> tuple[int, dict[str, dict]]:
        return self.core.get_profiles()

    def set_profile(self, name: str, profile: dict[str, Any], expected_version: int | None = None) -> int:
        """Raises a `ProfileChangeRefused` (the caller gets it back through the handle)."""
        return self.core.set_profile(name, profile, expected_version)

    def delete_profile(self, name: str, expected_version: int | None = None) -> int:
        return self.core.delete_profile(name, expected_version)

    def push_metrics(self, source_id: str, snapshot: metrics.Snapshot | str) -> None:
        self.core.push_metrics(source_id, snapshot)

    def now(self) -> float:
        return self.core.now()

    def stale_sources(self, since: float) -> list[str]:
        return self.core.stale_sources(since)

    def render_metrics(self) -> bytes:
        return self.core.render_metrics()
