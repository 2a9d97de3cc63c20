"""The workloads `pdcluster demo` and `pdcluster bench cluster` send, stated explicitly.

Each workload is one or more request classes with fixed lengths and an arrival process,
written as a JSONL trace (`timestamp`, `id`, `prompt_len`, `output_len`, `workload` per
row) that `pdcluster loadtest --trace` replays. `workload` is the class's workload profile
(`bench_short`, `bench_long`), sent as `x-workload`: where the app has that profile, the
router holds each class to its own SLO; elsewhere the name falls back to `default`. The trace fixes lengths and arrival times; the
prompt text comes from the load test's seed, so every run of a benchmark sends the same
shape of traffic with fresh prompt bytes (no run can hit the prefix cache of another).

Lengths are tokens of the byte-level tokenizer of the embedded models. The speeds they
were sized for (the `small` preset, one torch thread per replica, 2 cores): a
1024-token prefill takes ~1.5-2.5 s, one decode step of a few streams ~30-60 ms.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

from cluster.loadtest.config import SLO

WORKLOAD_PREFIX = "bench_"  # class `short` -> workload profile `bench_short`


@dataclass(frozen=True)
class RequestClass:
    """One kind of request in a workload: its lengths and its arrival process.

    Arrivals are Poisson at `rate` per second, or every `interval_s` seconds when that is
    set; the first arrives at `start_s`; `num_requests` of them in all."""

    name: str
    prompt_len: tuple[int, int]  # uniform, inclusive
    output_len: int
    num_requests: int
    rate: float | None = None
    interval_s: float | None = None
    start_s: float = 0.0
    slo: SLO = SLO()  # what "good" means for this class (goodput counts requests meeting it)

    def arrivals(self, rng: random.Random) -> list[float]:
        times, t = [], self.start_s
        for _ in range(self.num_requests):
            times.append(round(t, 4))
            t += self.interval_s if self.interval_s is not None else rng.expovariate(self.rate)
        return times

    @property
    def workload(self) -> str:
        """The workload profile its requests name in `x-workload`."""
        return f"{WORKLOAD_PREFIX}{self.name}"

    def describe(self) -> str:
        low, high = self.prompt_len
        prompt = f"{low}" if low == high else f"{low}-{high}"
        when = (f"every {self.interval_s:g} s from {self.start_s:g} s" if self.interval_s is not None
                else f"Poisson {self.rate:g}/s")
        slo = ", ".join(f"{k}={v:.0f}" for k, v in self.slo.as_dict().items())
        return f"{self.num_requests} x {self.name}: prompt {prompt}, output {self.output_len}, {when}; SLO {slo}"


@dataclass(frozen=True)
class ClusterWorkload:
    name: str
    purpose: str
    classes: tuple[RequestClass, ...]

    @property
    def slo(self) -> SLO:
        """The first class's SLO: what the load tester's own summary uses (the figures
        here count each request against its own class's SLO)."""
        return self.classes[0].slo

    def slo_of(self, class_name: str) -> SLO:
        return next((c.slo for c in self.classes if c.name == class_name), self.slo)

    @property
    def num_requests(self) -> int:
        return sum(c.num_requests for c in self.classes)

    def rows(self, seed: int = 0) -> list[dict]:
        """The trace rows, in arrival order."""
        rows = []
        for cls in self.classes:
            rng = random.Random(f"{self.name}:{cls.name}:{seed}")
            for i, t in enumerate(cls.arrivals(rng)):
                rows.append({"timestamp": t, "id": f"{cls.name}-{i}", "prompt_len": rng.randint(*cls.prompt_len),
                             "output_len": cls.output_len, "workload": cls.workload})
        return sorted(rows, key=lambda r: (r["timestamp"], r["id"]))

    def write_trace(self, path: Path, seed: int = 0) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in self.rows(seed)))
        return path

    def scaled(self, request_factor: float = 1.0, prompt_factor: float = 1.0,
               rate_factor: float = 1.0) -> ClusterWorkload:
        """A resized copy (smoke tests, `--quick`, `--num-requests`): requests, prompt
        lengths and arrival rates each scaled; the mix of classes stays."""
        classes = tuple(replace(c, num_requests=max(1, round(c.num_requests * request_factor)),
                                prompt_len=tuple(max(1, round(n * prompt_factor)) for n in c.prompt_len),
                                rate=None if c.rate is None else c.rate * rate_factor,
                                interval_s=None if c.interval_s is None else c.interval_s / rate_factor,
                                start_s=c.start_s / rate_factor)
                        for c in self.classes)
        return replace(self, classes=classes)

    def describe(self) -> list[str]:
        return [f"{self.name}: {self.purpose}", *(f"  {c.describe()}" for c in self.classes)]


# The demo's workload, fixed: short-prompt streams decode while long prompts arrive, what
# disaggregation is for. In a colocated replica each long prompt's prefill chunks stall
# every stream decoding beside it.
INTERFERENCE = ClusterWorkload(
    "interference",
    "short-prompt streams decode while long prompts arrive",
    (RequestClass("short", (64, 128), 48, num_requests=30, rate=1.5, slo=SLO(ttft_ms=1000, tpot_ms=100)),
     RequestClass("long", (1536, 1536), 8, num_requests=4, interval_s=5.0, start_s=2.0,
                  slo=SLO(ttft_ms=8000, tpot_ms=200))),
)


def request_class(request_id: str) -> str:
    """`short-3` -> `short` (the load tester prefixes a run id to x-request-id, not to the
    record's own id)."""
    return request_id.rsplit("-", 1)[0]
