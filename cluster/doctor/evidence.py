"""What `doctor` reads, gathered in one place: the metrics window, `/health`, the admin
view of profiles and engines (when a token is set), and a load-test run's records."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cluster.doctor.window import Window
from cluster.loadtest.client import RequestRecord

DEFAULT_MIN_REMOTE = 256  # the profile defaults, used when the profiles cannot be read
DEFAULT_MAX_LOCAL_BESIDE_STREAMS = 512


@dataclass
class Evidence:
    window: Window | None = None  # the live window, or the run's own
    health: dict[str, Any] | None = None
    profiles: dict[str, dict] | None = None  # name -> profile (admin API)
    engine: dict[str, Any] | None = None  # the router's engine settings (max_num_seqs, block_size)
    policy: dict[str, Any] | None = None  # the routing policy's own view (GET /admin/policy)
    records: list[RequestRecord] = field(default_factory=list)
    source: str = ""  # what the window is: "live, 10 s" or the run folder
    notes: list[str] = field(default_factory=list)  # what could not be read, and why

    def profile(self, workload: str) -> dict[str, Any]:
        profiles = self.profiles or {}
        return profiles.get(workload) or profiles.get("default") or {}

    def min_remote_prefill_tokens(self, workload: str) -> int:
        return int(self.profile(workload).get("min_remote_prefill_tokens", DEFAULT_MIN_REMOTE))

    def max_local_beside_streams(self, workload: str) -> int:
        return int(self.profile(workload).get("max_local_prefill_tokens_while_decoding",
                                              DEFAULT_MAX_LOCAL_BESIDE_STREAMS))

    def max_num_seqs(self) -> int | None:
        value = (self.engine or {}).get("max_num_seqs")
        return int(value) if value else None

    def ok_records(self) -> list[RequestRecord]:
        return [r for r in self.records if r.ok]

    def workloads(self) -> list[str]:
        return sorted({r.workload for r in self.records})
