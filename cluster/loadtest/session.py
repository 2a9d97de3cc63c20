"""A run's session with the server (what it learned before sending load), one plan run in
this process or over Ray actors, and the environment block that makes a run reproducible.
Shared by a single run (`api.py`), the sweep and the distributed runner."""

from __future__ import annotations

import datetime
import platform
import secrets
import sys
from dataclasses import dataclass

from cluster.loadtest.client import (
    Caps,
    RequestRecord,
    Target,
    fetch_models,
    make_http_client,
    probe,
)
from cluster.loadtest.config import LoadTestConfig
from cluster.loadtest.metrics import latency_block, schedule_lag_ms
from cluster.loadtest.runner import OnRecord, Plan, execute, run_sync


@dataclass
class Session:
    """What the run learned from the server before sending load."""

    target: Target
    caps: Caps
    models: dict | None


def make_target(config: LoadTestConfig, model: str | None) -> Target:
    return Target(config.url, config.endpoint, model, config.request_headers(), config.stream,
                  config.timeout_s, run_id=secrets.token_hex(3) + "-")


def open_session(config: LoadTestConfig) -> Session:
    """Fetch `/v1/models` (its first id is the default model) and probe the request form."""

    async def go() -> Session:
        async with make_http_client() as http:
            models = await fetch_models(http, config.url, config.request_headers())
            model = config.model or _first_model_id(models)
            target = make_target(config, model)
            if config.prompt_format == "text" and config.endpoint == "chat":
                caps = Caps(False, False)
            else:
                caps = await probe(http, target, config.prompt_format)
            return Session(target, caps, models)

    return run_sync(go())


def _first_model_id(models: dict | None) -> str | None:
    try:
        return models["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return None


def run_plan(config: LoadTestConfig, session: Session, plan: Plan, on_record: OnRecord | None = None,
             loop_lags_s: list[float] | None = None) -> list[RequestRecord]:
    """Run one plan, in this process or over `config.clients` Ray actors."""
    if config.clients > 1:
        from cluster.loadtest.distributed import run_distributed

        return run_distributed(plan, session.target, session.caps, config.clients, on_record, loop_lags_s)
    return run_sync(execute(plan, session.target, session.caps, on_record=on_record, loop_lags_s=loop_lags_s))


def environment(config: LoadTestConfig, session: Session, plan: Plan | None, records: list[RequestRecord],
                loop_lags_s: list[float] | None = None) -> dict:
    """What a reader needs to reproduce the run. Header values are left out (API keys)."""
    import httpx

    return {
        "target": config.url,
        "endpoint": config.endpoint,
        "model": session.target.model,
        "workload": config.workload,
        "seed": config.seed,
        "prompt_salt": config.prompt_salt,
        "load": config.describe_shape(),
        "num_requests": config.effective_num_requests,
        "duration_limit_s": config.duration_s,
        "mode": config.mode,
        "clients": config.clients,
        "stream": config.stream,
        "prompt_format": "token_ids" if session.caps.token_ids else "text",
        "exact_output_len": session.caps.extensions,
        "header_names": sorted(config.request_headers()),
        "schedule_rate": _schedule_rate(plan),
        "schedule_lag_ms": schedule_lag_ms(records),
        "client_loop_lag_ms": latency_block(loop_lags_s) if loop_lags_s else None,
        "server_models": session.models,
        "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "versions": {"python": platform.python_version(), "pdcluster": _version("pdcluster"),
                     "httpx": httpx.__version__, "ray": _version("ray")},
        "argv": sys.argv if sys.argv and sys.argv[0].endswith("pdcluster") else None,
    }


def _schedule_rate(plan: Plan | None) -> float | None:
    """The rate the precomputed schedule itself realizes: (N - 1) / span of its offsets."""
    if plan is None or not plan.offsets or len(plan.offsets) < 2 or plan.offsets[-1] <= 0:
        return None
    return round((len(plan.offsets) - 1) / plan.offsets[-1], 4)


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None
