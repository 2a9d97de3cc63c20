"""Plain counters the cluster exports as Prometheus metrics.

`pdc_kv_transfer_bytes_total` <- `bytes_total`; `pdc_kv_transfer_seconds{backend}` <- the
observers (one call per completed transfer, for a histogram) or `seconds_total`.
Rejections are counted by reason ("bad_mac", "unknown", "replay", "fingerprint", ...).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

TransferObserver = Callable[[str, int, float], None]  # (backend, nbytes, seconds)


class TransportMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes_total: Counter[str] = Counter()  # by backend (data path)
        self.seconds_total: Counter[str] = Counter()  # by backend
        self.transfers_total: Counter[str] = Counter()  # by outcome: ok or the error kind
        self.rejections_total: Counter[str] = Counter()  # by reason
        self._observers: list[TransferObserver] = []

    def add_observer(self, observer: TransferObserver) -> None:
        """Called after every completed transfer, e.g. to feed a histogram."""
        self._observers.append(observer)

    def transfer_done(self, backend: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            self.bytes_total[backend] += nbytes
            self.seconds_total[backend] += seconds
            self.transfers_total["ok"] += 1
        for observer in self._observers:
            observer(backend, nbytes, seconds)

    def transfer_failed(self, kind: str) -> None:
        with self._lock:
            self.transfers_total[kind] += 1

    def rejected(self, reason: str) -> None:
        with self._lock:
            self.rejections_total[reason] += 1

    def snapshot(self) -> dict[str, dict[str, float]]:
        with self._lock:
            return {"bytes_total": dict(self.bytes_total),
                    "seconds_total": dict(self.seconds_total),
                    "transfers_total": dict(self.transfers_total),
                    "rejections_total": dict(self.rejections_total)}
