"""Helpers for the reliability suite and its report: deploy the app, reach every worker
replica, check the invariants, stream over real HTTP, kill a replica, record figures."""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from workers.invariants import Probe, idle_violations

APP = "pdc-reliability"
MAX_MODEL_LEN = 2048
FIGURES: dict[str, list] = {}  # name -> measured values, written by write_figures()
_lock = threading.Lock()


SOAK_MIX = {  # the built-in mix, sized for the suite's max_model_len
    "workload": "mixed",
    "chat-short": {"prompt_len": [32, 128], "output_len": [8, 32]},
    "rag-long": {"prompt_len": [300, 400], "output_len": [8, 16]},
    "shared-prefix": {"prompt_len": [16, 48], "output_len": [8, 16], "prefix_len": 192},
    "multi-turn": {"prompt_len": [16, 48], "output_len": [8, 16], "turns": 3},
}


def record(name: str, value) -> None:
    with _lock:
        FIGURES.setdefault(name, []).append(value)


def write_figures() -> None:
    out = os.environ.get("PDC_RELIABILITY_OUT")
    if out:
        path = Path(out)
        old = json.loads(path.read_text()) if path.exists() else {}
        for name, values in FIGURES.items():
            old.setdefault(name, []).extend(values)
        path.write_text(json.dumps(old, indent=1))


@dataclass
class Secrets:
    admin_token: str = field(default_factory=lambda: "adm-" + secrets.token_hex(16))
    transport_key: str = field(default_factory=lambda: "kvk-" + secrets.token_hex(16))
    keys: dict[str, str] = field(default_factory=lambda: {
        name: f"sk-{name}-{secrets.token_hex(12)}" for name in ("main", "limited", "single", "batch")})

    def values(self) -> list[str]:
        return [self.admin_token, self.transport_key, *self.keys.values()]


def write_secret_files(folder: Path, s: Secrets) -> dict:
    (folder / "admin").write_text(s.admin_token)
    (folder / "kv").write_text(s.transport_key)
    keys = {
        "keys": {
            s.keys["main"]: {"tenant": "main"},
            s.keys["limited"]: {"tenant": "limited", "rate": 1, "burst": 2},
            s.keys["single"]: {"tenant": "single", "concurrency": 1},
            s.keys["batch"]: {"tenant": "nightly", "workload": "batch", "priority": "batch"},
        },
        "default": {"concurrency": 64},
    }
    (folder / "keys.yaml").write_text(yaml.safe_dump(keys))
    return {"admin_token_file": str(folder / "admin"), "transport_key_file": str(folder / "kv"),
            "api_keys_file": str(folder / "keys.yaml")}


def app_config(model_dir: Path, secret_files: dict) -> dict:
    return {
        "model": {"path": str(model_dir), "max_model_len": MAX_MODEL_LEN},
        "engine": {"num_kv_blocks": 1024, "max_num_batched_tokens": 256},
        "prefill": {"num_replicas": 1, "num_cpus": 0.25},
        "decode": {"num_replicas": 2, "num_cpus": 0.25},
        "router": {"num_cpus": 0.25, "heartbeat_timeout_s": 3.0, "prefill_timeout_s": 3.0,
                   "max_body_bytes": 64 * 1024},
        "transport": {"backend": "zmq", "host": "127.0.0.1", "transfer_timeout_s": 3.0},
        "limits": {"default_max_tokens": 4, "max_tokens_limit": 1500},
        "admission": {"max_concurrent_requests": 12, "max_queued_requests": 6, "queue_timeout_s": 10},
        "workloads": {"default": {"mode": "threshold", "min_remote_prefill_tokens": 32},
                      "tight": {"mode": "threshold", "min_remote_prefill_tokens": 32, "deadline_s": 1.0},
                      "batch": {"mode": "local"}},
        "secrets": secret_files,
        "faults": {"enabled": True},  # test hooks on; no fault until a test sets one
    }


# ---- replicas --------------------------------------------------------------------------


def replicas(role: str | None = None) -> list:
    from ray import serve

    control = serve.get_deployment_handle("ControlPlane", APP)
    state = control.get_state.remote(None).result(timeout_s=30)
    return [r for r in state.replicas if r.healthy and (role is None or r.role == role)]


def _handle(role: str):
    from ray import serve

    return serve.get_deployment_handle("DecodeWorker" if role == "decode" else "PrefillWorker", APP)


def debug_state(replica) -> dict | None:
    """The replica's own state, or None when Serve no longer routes to it."""
    state = _handle(replica.role).debug_state.remote(Probe(replica.replica_id)).result(timeout_s=30)
    return state if state["replica_id"] == replica.replica_id else None


def set_faults(spec: dict) -> list[dict]:
    return [_handle("prefill").set_faults.remote(spec, Probe(r.replica_id)).result(timeout_s=30)
            for r in replicas("prefill")]


def wait_all_idle(timeout_s: float = 15.0) -> tuple[float, dict[str, list[str]]]:
    """Seconds until every live replica is idle with its invariants intact, and what was
    still busy if the timeout came first. `debug_state` raises if an invariant breaks."""
    start = time.monotonic()
    problems: dict[str, list[str]] = {}
    while True:
        problems = {}
        for replica in replicas():
            state = debug_state(replica)
            if state is not None and idle_violations(state):
                problems[replica.replica_id] = idle_violations(state)
        elapsed = time.monotonic() - start
        if not problems or elapsed > timeout_s:
            return elapsed, problems
        time.sleep(0.02)


def kill_replica(replica_id: str) -> None:
    import ray

    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith("#" + replica_id) and APP in actor["name"]:
            ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
            return
    raise AssertionError(f"no actor for replica {replica_id}")


def wait_health(client: httpx.Client, num_decode: int = 2, num_prefill: int = 1,
                timeout_s: float = 120.0) -> float:
    start = time.monotonic()
    body: dict = {}
    while time.monotonic() - start < timeout_s:
        try:
            body = client.get("/health").json()
            pools = body.get("pools", {})
            if (body.get("status") == "ok" and pools.get("decode", {}).get("healthy") == num_decode
                    and pools.get("prefill", {}).get("healthy") == num_prefill):
                return time.monotonic() - start
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"cluster not healthy after {timeout_s} s: {body}")


# ---- HTTP --------------------------------------------------------------------------------


def completion(prompt, **body) -> dict:
    return {"prompt": prompt, "temperature": 0, **body}


@dataclass
class StreamResult:
    status: int
    headers: dict
    events: list = field(default_factory=list)  # parsed JSON events (and "[DONE]")
    seconds: float = 0.0

    @property
    def done(self) -> bool:
        return bool(self.events) and self.events[-1] == "[DONE]"

    @property
    def error(self) -> dict | None:
        errors = [e["error"] for e in self.events if isinstance(e, dict) and "error" in e]
        return errors[0] if errors else None

    @property
    def num_tokens(self) -> int:
        return sum(len(c.get("token_ids") or []) for e in self.events if isinstance(e, dict)
                   for c in e.get("choices", []))


def stream(client: httpx.Client, body: dict, headers: dict, on_event=None) -> StreamResult:
    """POST a streaming completion; `on_event(result)` after each event may return True
    to hang up (the client leaves mid-stream)."""
    start = time.monotonic()
    body = {**body, "stream": True, "return_token_ids": True}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as r:
        result = StreamResult(r.status_code, dict(r.headers))
        if r.status_code != 200:
            r.read()
            result.events.append(r.json())
            return result
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            result.events.append(data if data == "[DONE]" else json.loads(data))
            if on_event is not None and on_event(result):
                break
    result.seconds = time.monotonic() - start
    return result


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    """An OpenAI-shaped error of `status` (and `code`), without a traceback."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in r.text
    if code is not None:
        assert error["code"] == code, error
    return error


def metric_samples(client: httpx.Client, name: str) -> list[tuple[dict, float]]:
    """(labels, value) of every sample named `name` on `/metrics`."""
    from prometheus_client.parser import text_string_to_metric_families

    families = text_string_to_metric_families(client.get("/metrics").text)
    return [(s.labels, s.value) for f in families for s in f.samples if s.name == name]


def wait_for(found, timeout_s: float) -> float:
    """Seconds until `found()` is truthy (fails after `timeout_s`)."""
    start = time.monotonic()
    while not found():
        assert time.monotonic() - start < timeout_s, "timed out"
        time.sleep(0.2)
    return time.monotonic() - start


def ray_log_leaks(values: list[bytes]) -> tuple[list[tuple[str, bytes]], int]:
    """(file, the value's first bytes) for each of `values` found in a log file of this
    Ray session, and the number of files read."""
    import ray

    session_dir = Path(ray._private.worker._global_node.get_session_dir_path())
    leaks, num_files = [], 0
    for path in (session_dir / "logs").rglob("*"):
        if path.is_file():
            num_files += 1
            data = path.read_bytes()
            leaks += [(str(path), v[:6]) for v in values if v in data]
    return leaks, num_files
