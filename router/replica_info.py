"""One worker replica as the ControlPlane's registry holds it: its role and address, and
the stats its last heartbeat reported."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ReplicaInfo:
    """One worker replica as its last heartbeat reported it (the ControlPlane's registry)."""

    replica_id: str  # Serve's replica unique id (what `target_replica` names)
    role: str  # "prefill" | "decode"
    node_id: str = ""
    address: str | None = None  # the replica's advertised KV transport address
    healthy: bool = True
    last_heartbeat: float = 0.0
    # num_running, num_waiting, num_inflight, kv_blocks_free, kv_blocks_total, max_num_seqs, ...
    stats: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # what the worker added at register

    @property
    def load(self) -> int:
        """Running + waiting, read once per stats dict (a heartbeat's stats are replaced,
        never changed in place; placement reads this per replica per request)."""
        s = self.stats
        cached = self.__dict__.get("_load")
        if cached is None or cached[0] is not s:
            cached = self.__dict__["_load"] = (s, int(s.get("num_running", 0)) + int(s.get("num_waiting", 0)))
        return cached[1]

    @property
    def kv_pool_blocks(self) -> int | None:
        """Its KV pool in blocks (`kv_blocks_total`); None where the heartbeat reports
        none, or none readable."""
        try:
            blocks = int(self.stats.get("kv_blocks_total") or 0)
        except (TypeError, ValueError):
            return None
        return blocks if blocks > 0 else None

    @property
    def queue_len(self) -> int:
        return int(self.stats.get("num_waiting", 0))
