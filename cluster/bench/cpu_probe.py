"""Who used the CPU during a run: each Serve replica of the apps, the HTTP proxy, the
controller and this (client) process, from the processes' own CPU times.

On two cores the router, the proxy, the load tester's client and two engine replicas
all compete; these figures say which replica was busy and what the rest cost."""

from __future__ import annotations

import os
from dataclasses import dataclass, field


def _label(cmdline: list[str]) -> str | None:
    """`ray::ServeReplica:pd:DecodeWorker.method` -> `pd:DecodeWorker`; Serve's own
    actors by role. Ray sets each actor process's title to `ray::<actor>.<task>`."""
    title = cmdline[0] if cmdline else ""
    if not title.startswith("ray::"):
        return None
    actor = title[len("ray::"):].split(".", 1)[0].split(" ", 1)[0]
    if actor.startswith("ServeReplica:"):
        return actor.split(":", 1)[1]
    if actor in ("ProxyActor", "ServeController"):
        return actor
    return None


@dataclass
class CpuProbe:
    """`probe = CpuProbe.for_serve(); before = probe.sample(); ...; probe.used(before)`."""

    processes: dict[str, object] = field(default_factory=dict)  # label -> psutil.Process

    @classmethod
    def for_serve(cls) -> CpuProbe:
        """This process and the Serve actors among its descendants (the Ray it started)."""
        import psutil

        me = psutil.Process(os.getpid())
        processes: dict[str, object] = {"client": me}
        counts: dict[str, int] = {}
        for p in me.children(recursive=True):
            try:
                label = _label(p.cmdline())
            except psutil.Error:
                continue
            if label is not None:
                counts[label] = counts.get(label, 0) + 1
                processes[f"{label}#{counts[label]}"] = p
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
