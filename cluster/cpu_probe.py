"""Who used the CPU during a run: each Serve replica of the apps, the HTTP proxy, the
controller and this (client) process, from the processes' own CPU times.

On two cores the router, the proxy, the load tester's client and two engine replicas
all compete; these figures say which replica was busy and what the rest cost."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _label(class_name: str) -> str | None:
    """`ServeReplica:pd:DecodeWorker` -> `pd:DecodeWorker`; Serve's own actors by role."""
    if class_name.startswith("ServeReplica:"):
        return class_name.split(":", 1)[1]
    if class_name in ("ProxyActor", "ServeController"):
        return class_name
    return None


@dataclass
class CpuProbe:
    """`probe = CpuProbe.for_serve(); before = probe.sample(); ...; probe.used(before)`."""

    processes: dict[str, object] = field(default_factory=dict)  # label -> psutil.Process

    @classmethod
    def for_serve(cls) -> CpuProbe:
        import psutil
        from ray.util.state import list_actors

        processes: dict[str, object] = {"client": psutil.Process(os.getpid())}
        counts: dict[str, int] = {}
        for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
            label = _label(actor.class_name or "")
            if label is None or not actor.pid:
                continue
            counts[label] = counts.get(label, 0) + 1
            try:
                processes[f"{label}#{counts[label]}"] = psutil.Process(actor.pid)
            except psutil.Error:
                continue
        return cls(processes)

    def sample(self) -> dict[str, float]:
        import psutil

        out = {}
        for label, p in self.processes.items():
            try:
                t = p.cpu_times()
                out[label] = t.user + t.system
            except psutil.Error:
                continue
        return out

    def used(self, before: dict[str, float]) -> dict[str, float]:
        """CPU seconds per process since `before`, largest first."""
        now = self.sample()
        used = {k: round(now[k] - before[k], 2) for k in now if k in before}
        return dict(sorted(used.items(), key=lambda kv: -kv[1]))
