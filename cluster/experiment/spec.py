"""The experiment file: what to send, the baseline, and variants that change one thing.

A variant changes a workload profile field (through the admin API) or a client-side
setting (`x-pd-mode`, the endpoint, a header). One that changes more than one thing is
refused unless it says `multiple_changes: true`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.config import WorkloadProfile

Mode = Literal["auto", "threshold", "disagg", "local"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Checks(_Strict):
    """Optional checks on a sample's output text."""

    exact: str | None = None
    regex: str | None = None
    json_: bool = Field(default=False, alias="json")
    json_schema: dict[str, Any] | None = None

    def names(self) -> list[str]:
        return [name for name, on in (("exact", self.exact is not None), ("regex", self.regex is not None),
                                      ("json", self.json_), ("json_schema", self.json_schema is not None)) if on]


class Sample(_Strict):
    """One quality prompt, sent greedily under every variant."""

    id: str | None = None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    max_tokens: int = Field(default=32, ge=1)
    checks: Checks = Field(default_factory=Checks)

    @model_validator(mode="after")
    def _one_prompt(self) -> Sample:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a sample needs exactly one of 'prompt' and 'messages'")
        return self


class Client(_Strict):
    """Client-side settings: what the load generator sends."""

    mode: Mode | None = None  # sent as x-pd-mode
    endpoint: Literal["completions", "chat"] | None = None
    headers: dict[str, str] = Field(default_factory=dict)

    def items(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: v for k, v in (("mode", self.mode), ("endpoint", self.endpoint)) if v is not None}
        out.update({f"header {k}": v for k, v in self.headers.items()})
        return out


class Variant(_Strict):
    name: str = Field(min_length=1, max_length=64)
    profile: dict[str, Any] = Field(default_factory=dict)  # profile fields to change
    client: Client = Field(default_factory=Client)
    multiple_changes: bool = False  # allow more than one change, knowingly

    def changes(self) -> dict[str, Any]:
        return {**{f"profile.{k}": v for k, v in self.profile.items()},
                **{f"client.{k}": v for k, v in self.client.items().items()}}


class Baseline(_Strict):
    """The profile as it is (nothing given), or profile fields set for the baseline runs
    (the variants change one thing from there); client settings for every run."""

    profile: dict[str, Any] | None = None
    client: Client = Field(default_factory=Client)


class WorkloadRef(_Strict):
    name: str = Field(min_length=1, max_length=64)  # the profile: sent as x-workload
    load: str = "chat-short"  # a built-in workload or a workload file
    trace: str | None = None  # a trace.jsonl to replay instead (its timestamps set the arrivals)


class SLOSpec(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)


class ExperimentSpec(_Strict):
    name: str = "experiment"
    url: str | None = None
    workloads: list[WorkloadRef] = Field(min_length=1)
    rate: float | None = Field(default=None, gt=0)
    concurrency: int | None = Field(default=None, ge=1)
    num_requests: int | None = Field(default=None, ge=1)
    duration_s: float | None = Field(default=None, gt=0)
    endpoint: Literal["completions", "chat"] = "completions"
    slo: SLOSpec = Field(default_factory=SLOSpec)
    repeats: int = Field(default=3, ge=1, le=50)
    seed: int = 0
    baseline: Baseline = Field(default_factory=Baseline)
    variants: list[Variant] = Field(min_length=1)
    samples: list[Sample] = Field(default_factory=list)
    samples_file: str | None = None  # JSONL, one sample per line (added to `samples`)
    request_timeout_s: float = Field(default=120.0, gt=0)
    drain_timeout_s: float = Field(default=120.0, gt=0)
    plots: bool = True
    bootstrap_resamples: int = Field(default=1000, ge=100)
    min_effect: float = Field(default=0.05, ge=0)  # a smaller change is "within noise" even if consistent

    @model_validator(mode="after")
    def _check(self) -> ExperimentSpec:
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give rate (open loop) or concurrency (closed loop), not both")
        if self.num_requests is not None and self.duration_s is not None:
            raise ValueError("give num_requests or duration_s, not both")
        names = [v.name for v in self.variants]
        if "baseline" in names or len(set(names)) != len(names):
            raise ValueError("variant names must be unique and not 'baseline'")
        if len({w.name for w in self.workloads}) != len(self.workloads):
            raise ValueError("workload names must be unique")
        for variant in self.variants:
            _check_variant(variant)
        if self.baseline.profile:
            _check_fields(self.baseline.profile, "baseline.profile")
        return self

    def bound(self) -> dict[str, Any]:
        if self.duration_s is not None:
            return {"duration_s": self.duration_s}
        return {"num_requests": self.num_requests or 50}


def _check_fields(fields: dict[str, Any], where: str) -> None:
    unknown = sorted(set(fields) - set(WorkloadProfile.model_fields))
    if unknown:
        raise ValueError(f"{where}: unknown profile field {unknown[0]!r}; fields: "
                         f"{', '.join(WorkloadProfile.model_fields)}")
    try:
        WorkloadProfile.model_validate({**WorkloadProfile().model_dump(), **fields})
    except ValidationError as e:
        raise ValueError(f"{where}: {e.errors()[0]['loc']}: {e.errors()[0]['msg']}") from None


def _check_variant(variant: Variant) -> None:
    _check_fields(variant.profile, f"variant {variant.name!r}")
    changes = variant.changes()
    if len(changes) > 1 and not variant.multiple_changes:
        raise ValueError(f"variant {variant.name!r} changes {len(changes)} things ({', '.join(changes)}); "
                         "change one thing per variant, or say `multiple_changes: true` to compare them knowingly")


def load_spec(path: Path) -> ExperimentSpec:
    """Read and validate an experiment file; samples_file is read relative to it."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping (see docs/experiment.md)")
    try:
        spec = ExperimentSpec.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "file"
        raise ValueError(f"{path}: {where}: {first['msg']}") from None
    if spec.samples_file:
        file = (Path(path).parent / spec.samples_file).expanduser()
        rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
        spec = spec.model_copy(update={"samples": [*spec.samples, *(Sample.model_validate(r) for r in rows)]})
    return spec
