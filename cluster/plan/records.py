"""Step and KV transfer records as calibration reads them: each one the engine's own
`StepRecord` / `TransferRecord` plus the replica it came from and that replica's role.

On disk, a run directory holds `steps.jsonl` and `transfers.jsonl` beside the load
test's `requests.jsonl`, one record a line (the record's fields plus `replica_id` and
`role`), and `deployment.json` with the engine limits the replicas reported, when known.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from transport.transfer_record import TransferRecord
from workers.engine.step_cost import StepRecord

STEPS_FILE = "steps.jsonl"
TRANSFERS_FILE = "transfers.jsonl"
DEPLOYMENT_FILE = "deployment.json"  # {"engine": {...limits...}, "replicas": {id: {...}}}


@dataclass(frozen=True)
class ReplicaStep:
    replica_id: str
    role: str  # prefill | decode
    record: StepRecord


@dataclass(frozen=True)
class ReplicaTransfer:
    replica_id: str  # the sender (a prefill replica)
    role: str
    record: TransferRecord


@dataclass
class RecordSet:
    """What one source yielded: records from every replica, and what the deployment said
    about its engines (empty when it said nothing)."""

    steps: list[ReplicaStep] = dataclasses.field(default_factory=list)
    transfers: list[ReplicaTransfer] = dataclasses.field(default_factory=list)
    deployment: dict = dataclasses.field(default_factory=dict)

    def extend(self, other: RecordSet) -> None:
        self.steps += other.steps
        self.transfers += other.transfers
        _merge(self.deployment, other.deployment)


def _merge(into: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def step_of(row: dict) -> StepRecord:
    return StepRecord(**{f.name: row[f.name] for f in dataclasses.fields(StepRecord) if f.name in row})


def transfer_of(row: dict) -> TransferRecord:
    return TransferRecord(**{f.name: row[f.name] for f in dataclasses.fields(TransferRecord) if f.name in row})


def from_admin_answer(answer: dict) -> RecordSet:
    """`GET /admin/steps`'s body as records; replicas that answered with an error add none."""
    out = RecordSet(deployment={k: v for k, v in answer.items() if k != "replicas"})
    for replica_id, entry in answer.get("replicas", {}).items():
        role = entry.get("role", "")
        out.steps += [ReplicaStep(replica_id, role, step_of(r)) for r in entry.get("steps", ())]
        out.transfers += [ReplicaTransfer(replica_id, role, transfer_of(r)) for r in entry.get("transfers", ())]
        if entry.get("engine"):
            out.deployment.setdefault("replicas", {})[replica_id] = {"role": role, **entry["engine"]}
    return out


def write_run_records(out_dir: str | Path, records: RecordSet) -> None:
    """steps.jsonl, transfers.jsonl (time-ordered) and deployment.json into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_jsonl(out / STEPS_FILE, sorted(records.steps, key=lambda s: s.record.start_time))
    _write_jsonl(out / TRANSFERS_FILE, sorted(records.transfers, key=lambda s: s.record.start_time))
    (out / DEPLOYMENT_FILE).write_text(json.dumps(records.deployment, indent=1, sort_keys=True) + "\n")


def _write_jsonl(path: Path, items: Iterable[ReplicaStep | ReplicaTransfer]) -> None:
    with path.open("w") as f:
        for item in items:
            row = {"replica_id": item.replica_id, "role": item.role, **dataclasses.asdict(item.record)}
            f.write(json.dumps(row) + "\n")


def read_run_records(run_dir: str | Path) -> RecordSet:
    """A run directory's records; a missing transfers.jsonl or deployment.json reads as none."""
    run = Path(run_dir)
    steps_path = run / STEPS_FILE
    if not steps_path.exists():
        raise FileNotFoundError(f"{run}: no {STEPS_FILE}; run `pdcluster loadtest ... --save-steps` "
                                f"(or `bench cluster --save-steps`) against a deployment with the admin API on")
    out = RecordSet()
    out.steps = [ReplicaStep(r["replica_id"], r["role"], step_of(r)) for r in _read_jsonl(steps_path)]
    if (run / TRANSFERS_FILE).exists():
        out.transfers = [ReplicaTransfer(r["replica_id"], r["role"], transfer_of(r))
                         for r in _read_jsonl(run / TRANSFERS_FILE)]
    if (run / DEPLOYMENT_FILE).exists():
        out.deployment = json.loads((run / DEPLOYMENT_FILE).read_text())
    return out


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
