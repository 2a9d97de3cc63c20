"""A finding of `doctor` (the symptom, its numbers, what fits) and the small helpers the
symptom checks share."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from cluster.doctor.evidence import Evidence
from cluster.loadtest.client import RequestRecord

ROUTE_MIN_REQUESTS = 5  # per route (or in a window), for a comparison


@dataclass
class Finding:
    symptom: str
    title: str
    evidence: str
    fix: str
    numbers: dict[str, Any] = field(default_factory=dict)
    workload: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Check = Callable[[Evidence], list[Finding]]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def by_workload(records: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    groups: dict[str, list[RequestRecord]] = defaultdict(list)
    for r in records:
        groups[r.workload].append(r)
    return groups


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
