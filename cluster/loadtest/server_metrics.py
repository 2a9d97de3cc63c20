"""The server's `/metrics` over a run: sampled in the background while the load runs and
saved beside the run's records, so a later reader (`pdcluster doctor --run`, an
experiment's report) judges the deployment over exactly the run's window.

A run folder gains `metrics_start.prom` and `metrics_end.prom` (the whole exposition
just before the first and just after the last request: counters and histograms are read
as their difference) and `gauges.jsonl` (one line per sample: the time and the `pdc_*`
gauges, e.g. KV blocks free and requests waiting per replica).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

Series = list[tuple[dict[str, str], float]]  # (labels, value) per label set
Families = dict[str, Series]  # by sample name: `x_total`, `x_sum`, `x_count`, `x_bucket`, a gauge's name
START_FILE, END_FILE, GAUGES_FILE = "metrics_start.prom", "metrics_end.prom", "gauges.jsonl"
SAMPLE_INTERVAL_S = 0.5


def parse(text: str) -> Families:
    """Prometheus text as {sample name: [(labels, value), ...]}; `_created` left out."""
    families: Families = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                families.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return families


def gauges_of(text: str) -> Families:
    """Only the `pdc_*` gauges of an exposition."""
    gauges: Families = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge" and family.name.startswith("pdc_"):
            gauges[family.name] = [(dict(s.labels), float(s.value)) for s in family.samples]
    return gauges


def fetch(url: str, timeout_s: float = 8.0, client: httpx.Client | None = None, fresh: bool = False) -> str:
    """`GET URL/metrics` as text; raises httpx errors. `fresh`: the server first waits
    for every replica's next push, so the text holds everything observed before the call
    (a window's first and last sample ask for it)."""
    params = {"fresh": "true"} if fresh else None
    if client is not None:
        response = client.get(f"{url}/metrics", params=params, timeout=timeout_s)
    else:
        response = httpx.get(f"{url}/metrics", params=params, timeout=timeout_s)
    response.raise_for_status()
    return response.text


class MetricsRecorder:
    """Samples `/metrics` every `interval_s` on a thread; `stop()` takes the last sample
    and writes the three files. A sample that fails is skipped (the run goes on)."""

    def __init__(self, url: str, out_dir: Path, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.url, self.out_dir, self.interval_s = url.rstrip("/"), Path(out_dir), interval_s
        self.first: str | None = None
        self.last: str | None = None
        self.gauges: list[dict] = []
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="metrics-recorder", daemon=True)
        self._client = httpx.Client(timeout=8.0)

    def start(self) -> MetricsRecorder:
        self._sample(fresh=True)  # the window opens before the first request, after all earlier ones
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10.0)
        self._sample(fresh=True)  # and closes holding every observation of the run's requests
        self._client.close()
        self.write()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _sample(self, fresh: bool = False) -> None:
        try:
            text = fetch(self.url, client=self._client, fresh=fresh)
        except httpx.HTTPError:
            self.errors += 1
            return
        if self.first is None:
            self.first = text
        self.last = text
        self.gauges.append({"t": time.time(), "gauges": gauges_of(text)})

    def write(self) -> None:
        if self.first is None or self.last is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / START_FILE).write_text(self.first)
        (self.out_dir / END_FILE).write_text(self.last)
        with open(self.out_dir / GAUGES_FILE, "w") as f:
            for row in self.gauges:
                f.write(json.dumps(row) + "\n")


@contextmanager
def recording_metrics(url: str, out_dir: Path, interval_s: float = SAMPLE_INTERVAL_S) -> Iterator[MetricsRecorder]:
    recorder = MetricsRecorder(url, out_dir, interval_s).start()
    try:
        yield recorder
    finally:
        recorder.stop()
