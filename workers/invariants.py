"""What the fault suite checks on every replica after every scenario (`debug_state`).

`debug_state(worker)` runs the engine's own `check_integrity()` (block ref counts, free +
used == total, every request queued exactly once; it raises on a violation) and reports
the counters that must all return to zero when the replica is idle: running and waiting
requests, open KV reservations, transfers the receiver still expects, request streams.
`idle_violations(state)` names whichever of them is not at rest.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Probe:
    """Argument of `debug_state`/`set_faults` calls: the request router
    (router/replica_router.py) sends the call to the replica it names."""

    target_replica: str


async def debug_state(worker) -> dict[str, Any]:
    await worker.engine.check_integrity()
    state = await worker.stats()
    receiver = getattr(worker, "receiver", None)
    faults = getattr(worker, "faults", None)
    state.update(
        replica_id=worker.replica_id, role=worker.role, pid=os.getpid(),
        num_pending_transfers=len(receiver.pending_ids()) if receiver is not None else 0,
        num_streams=worker.engine.num_streams, rss_bytes=rss_bytes(),
        faults=faults.describe() if faults is not None else None)
    return state


def idle_violations(state: dict[str, Any]) -> list[str]:
    """Empty when the replica holds nothing: every block free, nothing pending."""
    problems = [f"{name}={state.get(name)}" for name in
                ("num_running", "num_waiting", "num_open_reservations", "num_pending_transfers",
                 "num_streams", "num_inflight", "num_stream_calls") if state.get(name, 0)]
    if state.get("kv_blocks_free") != state.get("kv_blocks_total"):
        problems.append(f"kv_blocks_free={state.get('kv_blocks_free')}/{state.get('kv_blocks_total')}")
    return problems


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
