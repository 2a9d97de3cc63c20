"""Tenants and their quotas, from the API keys file (`PDC_API_KEYS_FILE` or
`secrets.api_keys_file`), the same file `router/api_keys.py` reads for authentication.

    keys:                      # API key -> who it is
      sk-alpha-1: {tenant: alpha, workload: interactive}
      sk-batch-1: {tenant: nightly, workload: batch}
      sk-solo-1:  {tenant: solo, rate: 2, burst: 4, concurrency: 1, priority: batch}  # quotas inline
    tenants:                   # tenant -> quotas (all optional)
      alpha:   {rate: 20, burst: 40, concurrency: 8, priority: interactive}
      nightly: {rate: 5, concurrency: 2, priority: batch}
    default:                   # quotas of a tenant not listed (and of requests without a key)
      {concurrency: 16}

- `rate`: requests per second (token bucket refilled at this rate); `burst`: the bucket's
  size (default `max(1, rate)`): how many may arrive at once after a quiet period.
- `concurrency`: requests of this tenant running or queued at once.
- `priority`: `interactive` (default) or `batch`; when the router is full, queued
  interactive requests get a free slot before any queued batch request.

Quotas are per router replica; with `router.num_replicas: N` the admission layer divides
`rate`, `burst` and `concurrency` by N (rounding up) so the cluster-wide limit is the one
written here. A key's inline quotas override its tenant's entry. Unknown fields are an
error naming the key, so a typo never silently drops a limit. Key values never appear in
an error message or a log line; only tenant names do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

Priority = Literal["interactive", "batch"]
PRIORITY_RANK = {"interactive": 0, "batch": 1}  # lower is served first
ANONYMOUS = "anonymous"  # the tenant of requests when no keys file is configured


class QuotaSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rate: float | None = Field(default=None, gt=0)
    burst: int | None = Field(default=None, ge=1)
    concurrency: int | None = Field(default=None, ge=1)
    priority: Priority | None = None


class KeySpec(QuotaSpec):
    tenant: str = Field(default="default", min_length=1, max_length=64)
    workload: str | None = None


class TenantsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: dict[str, KeySpec | None] = Field(default_factory=dict)
    tenants: dict[str, QuotaSpec | None] = Field(default_factory=dict)
    default: QuotaSpec = Field(default_factory=QuotaSpec)


@dataclass(frozen=True)
class Quota:
    """One tenant's limits on one router replica (None: unlimited)."""

    rate: float | None = None
    burst: int | None = None
    concurrency: int | None = None
    priority: Priority = "interactive"

    @property
    def rank(self) -> int:
        return PRIORITY_RANK[self.priority]

    def per_replica(self, num_replicas: int) -> Quota:
        if num_replicas <= 1:
            return self
        return Quota(None if self.rate is None else self.rate / num_replicas,
                     _share(self.burst, num_replicas), _share(self.concurrency, num_replicas),
                     self.priority)


def _share(value: int | None, n: int) -> int | None:
    return None if value is None else max(1, math.ceil(value / n))


@dataclass(frozen=True)
class Tenants:
    by_tenant: dict[str, Quota]
    default: Quota

    def quota(self, tenant: str | None) -> Quota:
        return self.by_tenant.get(tenant or ANONYMOUS, self.default)

    def per_replica(self, num_replicas: int) -> Tenants:
        return Tenants({t: q.per_replica(num_replicas) for t, q in self.by_tenant.items()},
                       self.default.per_replica(num_replicas))

    @classmethod
    def unlimited(cls) -> Tenants:
        return cls({}, Quota())

    @classmethod
    def load(cls, path: Path | None) -> Tenants:
        """Quotas from the keys file; no file: every request is `anonymous`, unlimited
        per tenant (the router's global bound still applies)."""
        if path is None:
            return cls.unlimited()
        try:
            data = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read the API keys file {path}: {type(e).__name__}") from None
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: dict, source: str = "API keys file") -> Tenants:
        try:
            spec = TenantsFile.model_validate(data)
        except ValidationError as e:
            raise ValueError(f"{source}: {_describe(e, spec_keys=data)}") from None
        default = _quota(spec.default, None)
        by_tenant = {name: _quota(q or QuotaSpec(), default) for name, q in spec.tenants.items()}
        for key_spec in spec.keys.values():
            key_spec = key_spec or KeySpec()
            base = by_tenant.get(key_spec.tenant, default)
            inline = QuotaSpec.model_validate(key_spec.model_dump(include=set(QuotaSpec.model_fields)))
            if inline.model_dump(exclude_none=True):
                by_tenant[key_spec.tenant] = _quota(inline, base)
            else:
                by_tenant.setdefault(key_spec.tenant, base)
        return cls(by_tenant, default)


def _quota(spec: QuotaSpec, base: Quota | None) -> Quota:
    base = base or Quota()
    rate = spec.rate if spec.rate is not None else base.rate
    burst = spec.burst if spec.burst is not None else (
        base.burst if spec.rate is None else max(1, math.ceil(spec.rate)))
    return Quota(rate, burst if rate is not None else None,
                 spec.concurrency if spec.concurrency is not None else base.concurrency,
                 spec.priority or base.priority)


def _describe(error: ValidationError, spec_keys: dict) -> str:
    """Name the bad field; under `keys`, name the entry by its tenant, never the key."""
    lines = []
    for item in error.errors():
        loc = [str(p) for p in item["loc"]]
        if len(loc) >= 2 and loc[0] == "keys":
            entry = (spec_keys.get("keys") or {}).get(loc[1])
            tenant = entry.get("tenant", "?") if isinstance(entry, dict) else "?"
            loc[1] = f"<key of tenant {tenant}>"
        lines.append(f"{'.'.join(loc) or '(top level)'}: {item['msg']}")
    return "; ".join(lines)
