"""One run of an experiment (a workload under a variant in one repeat) and the facts the
report needs from it beyond per-request latency: errors, server-side KV use, preemptions,
prefix-cache hits and routes."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cluster.doctor.window import Window, read_window
from cluster.experiment.quality import SampleOutput
from cluster.loadtest.client import RequestRecord

DISCONNECTS = ("connection_lost", "incomplete_stream", "connect_error")


@dataclass(frozen=True)
class RunKey:
    index: int  # position in the interleaved order
    repeat: int
    workload: str
    variant: str

    @property
    def folder(self) -> str:
        return f"{self.index:03d}-{self.workload}-{self.variant}-r{self.repeat}"


@dataclass
class RunResult:
    key: RunKey
    out_dir: Path
    records: list[RequestRecord] = field(default_factory=list)
    samples: list[SampleOutput] = field(default_factory=list)
    started_at: float = 0.0
    ended_at: float = 0.0
    error: str | None = None  # the run failed as a whole

    def window(self) -> Window | None:
        return read_window(self.out_dir)

    def facts(self) -> dict[str, Any]:
        return {**request_facts(self.records), **server_facts(self.window())}


def request_facts(records: list[RequestRecord]) -> dict[str, Any]:
    errors = Counter(r.error_kind for r in records if r.error_kind)
    return {
        "requests": len(records),
        "errors": dict(errors),
        "timeouts": errors.get("timeout", 0),
        "rejected_429": errors.get("http_429", 0),
        "disconnects": sum(errors.get(kind, 0) for kind in DISCONNECTS),
        "routes": dict(Counter(r.route for r in records if r.route)),
        "reasons": dict(Counter(f"{r.route}:{r.reason}" for r in records if r.route and r.reason)),
    }


def server_facts(window: Window | None) -> dict[str, Any]:
    if window is None:
        return {"peak_kv_blocks_used": None, "preemptions": None, "prefix_cache_hit_rate": None}
    used = [t - f for t, f in zip(window.gauge("pdc_kv_blocks_total"), window.gauge("pdc_kv_blocks_free"),
                                   strict=False)]
    queries = window.counter("pdc_prefix_cache_queries")
    return {"peak_kv_blocks_used": max(used) if used else None,
            "preemptions": window.counter("pdc_num_preemptions"),
            "prefix_cache_hit_rate": window.counter("pdc_prefix_cache_hits") / queries if queries > 0 else None}


def save_samples(out_dir: Path, samples: list[SampleOutput]) -> None:
    with open(out_dir / "quality.jsonl", "w") as f:
        for s in samples:
            f.write(json.dumps(s.to_json()) + "\n")


def load_records(out_dir: Path) -> list[RequestRecord]:
    from cluster.loadtest.report import read_records

    return read_records(out_dir) if (out_dir / "requests.jsonl").exists() else []
