"""Build a `Calibration` from records: a live deployment's, run directories', or an
offline sweep's (`cluster/plan/sweep_source.py`). The fit and its held-out score are
`cluster/plan/fit.py`'s; this module adds what the records do not say by themselves
(the engine limits, the model's KV size, the device) from the deployment's own account
of itself, or from the caller where the deployment said nothing, and notes which.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cluster.config import EngineSettings
from cluster.plan.calibration import Calibration, EngineLimits, Source, StepModel
from cluster.plan.fit import fit_and_score, fit_reported, fit_transfers, split_held_out
from cluster.plan.live import fetch_records
from cluster.plan.model_facts import engine_version, model_facts
from cluster.plan.overhead import read_requests, request_overhead_s
from cluster.plan.records import RecordSet, ReplicaStep, read_run_records
from workers.engine.kv_cache import DEFAULT_CPU_KV_BYTES


class CalibrationError(ValueError):
    """The records cannot make a calibration; the message says what to do."""


@dataclass(frozen=True)
class Overrides:
    """What the caller says about the deployment where its records do not: used only
    for what the deployment did not report."""

    model_dir: str | None = None
    device: str | None = None
    dtype: str | None = None
    block_size: int | None = None
    num_kv_blocks: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    # fit the step model's node-contention term as the replicas do; off: the simulator
    # prices the serving path's CPU as its own queue, which the node board does not see,
    # and fitting both let each explain the other's share (replays of one bench plan run
    # scored worse with it: TTFT p50 max error 0.21 vs 0.16, saturation up to +51%)
    node_contention: bool = False


@dataclass
class _Told:
    """Each fact with where it came from, so the notes can say which were assumed."""

    values: dict = field(default_factory=dict)
    assumed: list[str] = field(default_factory=list)

    def take(self, key: str, *candidates, default=None):
        for value in candidates:
            if value is not None:
                self.values[key] = value
                return value
        self.assumed.append(key)
        self.values[key] = default
        return default


def from_live(url: str, token: str | None = None, overrides: Overrides = Overrides()) -> Calibration:
    records = fetch_records(url, token)
    return from_records(records, "live", overrides, f"records from {url}")


def from_runs(run_dirs: Sequence[str | Path], overrides: Overrides = Overrides()) -> Calibration:
    records, requests = RecordSet(), []
    for run in run_dirs:
        try:
            records.extend(read_run_records(run))
        except FileNotFoundError as e:
            raise CalibrationError(str(e)) from None
        requests.append(read_requests(run))
    return from_records(records, "run", overrides, f"records from {', '.join(str(r) for r in run_dirs)}",
                        requests)


def from_records(records: RecordSet, source: Source, overrides: Overrides, origin: str,
                 requests: Sequence[list] = ()) -> Calibration:
    """Fit and score on `records`; limits and model facts from the deployment's report,
    then `overrides`, then the defaults (named in the notes)."""
    if not records.steps:
        raise CalibrationError(f"no step records ({origin}); send the deployment some traffic first, or "
                               f"calibrate offline with --model DIR")
    steps = records.steps if overrides.node_contention else without_node_busy(records.steps)
    try:
        step, quality = fit_and_score(steps)
        reported = StepModel.of(fit_reported(split_held_out(steps)[0]))
    except ValueError as e:
        raise CalibrationError(str(e)) from None
    transfer, transfer_note = fit_transfers(records.transfers)
    told = _Told()
    limits = _limits(records, overrides, told)
    notes = [origin, f"{len(records.steps)} step and {len(records.transfers)} transfer records"]
    if not overrides.node_contention:
        notes.append("node contention not fitted (--node-contention fits it)")
    notes += [transfer_note] if transfer_note else []
    overhead = _overhead(requests, step, transfer, limits, notes)
    if told.assumed:
        notes.append("not reported by the deployment, assumed: " + ", ".join(
            f"{k}={told.values[k]}" for k in told.assumed))
    return Calibration(model=told.values["model"], engine_version=engine_version(), device=told.values["device"],
                       dtype=told.values["dtype"], source=source, created_at=time.time(), limits=limits,
                       step=step, transfer=transfer, quality=quality, request_overhead_s=overhead,
                       reported_step=reported,
                       notes="; ".join(notes))


def without_node_busy(steps: Sequence[ReplicaStep]) -> list[ReplicaStep]:
    """`steps` as if every replica had had its node to itself."""
    return [dataclasses.replace(s, record=dataclasses.replace(s.record, node_busy=0.0)) for s in steps]


def _limits(records: RecordSet, o: Overrides, told: _Told) -> EngineLimits:
    engine = records.deployment.get("engine", {})
    replica = _reporting_replica(records.deployment.get("replicas", {}))
    facts = model_facts(o.model_dir, o.dtype or engine.get("dtype") or "float32") if o.model_dir else None
    defaults = EngineSettings()
    layers = max((t.record.num_layers for t in records.transfers), default=None)
    told.take("model", engine.get("model"), facts.name if facts else None, default="unknown")
    told.take("device", engine.get("device"), o.device, default="unknown")
    told.take("dtype", engine.get("dtype"), o.dtype, default="float32")
    num_layers = told.take("num_layers", replica.get("num_layers"), layers, facts.num_layers if facts else None)
    kv_bytes = told.take("kv_bytes_per_token", replica.get("kv_bytes_per_token"),
                         facts.kv_bytes_per_token if facts else None)
    if num_layers is None or kv_bytes is None:
        raise CalibrationError("the records do not say the model's layers and KV size; give --model DIR "
                               "(the deployment's model folder)")
    block_size = told.take("block_size", engine.get("block_size"), o.block_size, default=defaults.block_size)
    return EngineLimits(
        block_size=block_size,
        num_kv_blocks=told.take("num_kv_blocks", replica.get("kv_blocks_total"), o.num_kv_blocks,
                                default=max(1, DEFAULT_CPU_KV_BYTES // (kv_bytes * block_size))),
        max_num_seqs=told.take("max_num_seqs", engine.get("max_num_seqs"), o.max_num_seqs,
                               default=defaults.max_num_seqs),
        max_num_batched_tokens=told.take("max_num_batched_tokens", replica.get("max_num_batched_tokens"),
                                         o.max_num_batched_tokens, default=defaults.max_num_batched_tokens),
        kv_bytes_per_token=kv_bytes, num_layers=num_layers)


def _reporting_replica(replicas: dict) -> dict:
    """A decode replica's report (its KV pool bounds the streams), else any replica's."""
    ranked = sorted(replicas.values(), key=lambda r: r.get("role") != "decode")
    return ranked[0] if ranked else {}


def _overhead(requests: Sequence[list], step, transfer, limits: EngineLimits, notes: list[str]) -> float:
    if not any(requests):
        notes.append("request_overhead_s: no requests.jsonl with the records, left at 0")
        return 0.0
    overhead, num_idle = request_overhead_s(requests, step, transfer, limits.max_num_batched_tokens,
                                            limits.kv_bytes_per_token)
    if overhead is None:
        notes.append(f"request_overhead_s: only {num_idle} requests ran alone, too few to measure; left at 0")
        return 0.0
    notes.append(f"request_overhead_s: client TTFT beyond the fitted engine TTFT over {num_idle} requests "
                 f"that ran alone")
    return overhead
