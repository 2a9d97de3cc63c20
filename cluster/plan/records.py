"""Step and KV transfer records as calibration reads them: each one the engine's own
`StepRecord` / `TransferRecord` plus the replica it came from and that replica's role.

On disk, a run directory holds `steps.jsonl` and `transfers.jsonl` beside the load
test's `requests.jsonl`, one record a line (the record's fields plus `replica_id` and
`role`), and `deployment.json` with the engine limits the replicas reported, when known.
Each source's steps are read with their node's decode rate (`with_node_rates`), which
only all of a node's records together can say.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from transport.transfer_record import TransferRecord
from workers.engine.cost_model import NODE_RATE_WINDOW_S
from workers.engine.step_cost import StepRecord

STEPS_FILE = "steps.jsonl"
TRANSFERS_FILE = "transfers.jsonl"
DEPLOYMENT_FILE = "deployment.json"  # {"engine": {...limits...}, "replicas": {id: {...}}}


@dataclass(frozen=True)
class ReplicaStep:
    replica_id: str
    role: str  # prefill | decode
    record: StepRecord
    node_decode_rate: float = 0.0  # the node's decode sequence-steps a second before it (`with_node_rates`)


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


def with_node_rates(steps: Sequence[ReplicaStep], nodes: dict[str, str] | None = None,
                    window_s: float = NODE_RATE_WINDOW_S) -> list[ReplicaStep]:
    """`steps` (one source's, every replica's), each with its node's decode rate: the
    decode sequences of the node's steps started in the `window_s` before it, a second.
    `nodes` maps a replica to its node; replicas it does not name share one node (a
    deployment on one machine, as a local run or a benchmark is)."""
    nodes = nodes or {}
    by_node: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        by_node.setdefault(nodes.get(s.replica_id, ""), []).append(i)
    out = list(steps)
    for members in by_node.values():
        members.sort(key=lambda i: steps[i].record.start_time)
        starts = np.array([steps[i].record.start_time for i in members])
        seqs = np.concatenate(([0.0], np.cumsum([steps[i].record.num_decode_seqs for i in members])))
        first = np.searchsorted(starts, starts - window_s)
        rates = (seqs[:-1] - seqs[first]) / window_s
        for i, rate in zip(members, rates, strict=True):
            out[i] = dataclasses.replace(steps[i], node_decode_rate=float(rate))
    return out


def node_of_replicas(deployment: dict) -> dict[str, str]:
    """{replica: node} where the deployment's account names its replicas' nodes."""
    return {rid: r["node_id"] for rid, r in deployment.get("replicas", {}).items() if r.get("node_id")}


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
        if entry.get("engine") or entry.get("node_id"):
            node = {"node_id": entry["node_id"]} if entry.get("node_id") else {}
            out.deployment.setdefault("replicas", {})[replica_id] = {"role": role, **node, **entry.get("engine", {})}
    out.steps = with_node_rates(out.steps, node_of_replicas(out.deployment))
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
    out.steps = with_node_rates(out.steps, node_of_replicas(out.deployment))
    return out


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
