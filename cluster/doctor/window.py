"""A window of the server's metrics: counters and histograms as the difference between
two expositions, gauges as the samples taken between them."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from cluster.loadtest.server_metrics import (
    END_FILE,
    GAUGES_FILE,
    START_FILE,
    Families,
    Series,
    parse,
)


def _matches(labels: dict[str, str], match: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match.items())


def _key(labels: dict[str, str]) -> tuple:
    return tuple(sorted(labels.items()))


@dataclass
class Window:
    start: Families
    end: Families
    gauges: list[tuple[float, Families]] = field(default_factory=list)
    seconds: float = 0.0

    def _deltas(self, sample: str, match: dict[str, str]) -> Series:
        before = {_key(labels): value for labels, value in self.start.get(sample, ())}
        return [(labels, value - before.get(_key(labels), 0.0))
                for labels, value in self.end.get(sample, ()) if _matches(labels, match)]

    def counter(self, name: str, **match: str) -> float:
        """The increase of counter `name` (its `_total` sample) over the window, summed
        over the label sets that match."""
        return sum(max(0.0, d) for _, d in self._deltas(f"{name}_total", match))

    def counter_by(self, name: str, label: str, **match: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, delta in self._deltas(f"{name}_total", match):
            if delta > 0:
                out[labels.get(label, "")] = out.get(labels.get(label, ""), 0.0) + delta
        return out

    def histogram(self, name: str, **match: str) -> tuple[float, float]:
        """(observations, their sum) added over the window."""
        count = sum(d for _, d in self._deltas(f"{name}_count", match))
        total = sum(d for _, d in self._deltas(f"{name}_sum", match))
        return max(0.0, count), max(0.0, total)

    def mean(self, name: str, **match: str) -> float | None:
        count, total = self.histogram(name, **match)
        return total / count if count > 0 else None

    def histogram_by(self, name: str, label: str, **match: str) -> dict[str, tuple[float, float]]:
        out: dict[str, list[float]] = {}
        sums = {_key(labels): d for labels, d in self._deltas(f"{name}_sum", match)}
        for labels, count in self._deltas(f"{name}_count", match):
            if count > 0:
                entry = out.setdefault(labels.get(label, ""), [0.0, 0.0])
                entry[0] += count
                entry[1] += sums.get(_key(labels), 0.0)
        return {k: (c, s) for k, (c, s) in out.items()}

    def gauge(self, name: str, **match: str) -> list[float]:
        """Per sample, the gauge summed over the matching label sets (e.g. a whole pool)."""
        return [sum(v for labels, v in fams.get(name, ()) if _matches(labels, match))
                for _, fams in self.gauges if name in fams]


def from_texts(start: str, end: str, gauges: list[tuple[float, Families]] | None = None,
               seconds: float = 0.0) -> Window:
    return Window(parse(start), parse(end), list(gauges or []), seconds)


def read_window(run_dir: Path) -> Window | None:
    """The metrics a run folder saved (`loadtest --save-metrics`), or None."""
    run_dir = Path(run_dir)
    if not (run_dir / START_FILE).exists() or not (run_dir / END_FILE).exists():
        return None
    gauges: list[tuple[float, Families]] = []
    if (run_dir / GAUGES_FILE).exists():
        for line in (run_dir / GAUGES_FILE).read_text().splitlines():
            row = json.loads(line)
            gauges.append((row["t"], {k: [(dict(lv[0]), float(lv[1])) for lv in v]
                                      for k, v in row["gauges"].items()}))
    seconds = gauges[-1][0] - gauges[0][0] if len(gauges) > 1 else 0.0
    return from_texts((run_dir / START_FILE).read_text(), (run_dir / END_FILE).read_text(), gauges, seconds)
