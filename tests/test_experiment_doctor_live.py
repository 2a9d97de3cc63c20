"""`pdcluster doctor` and `pdcluster experiment` against one real Serve app.

Each doctor symptom is produced on purpose (a workload file, a profile, a fault on the KV
link) by a real load test whose folder keeps the server's metrics over its own window;
`doctor` must name it there and name nothing on a healthy run. The experiment runs end
to end (two variants, two repeats, a quality set) and is killed mid-way once to prove
`--rollback`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from cluster.doctor.collect import collect
from cluster.doctor.symptoms import diagnose
from tests.serve_support import wait_ok

APP = "pdc-diagnosis"
TOKEN = "diagnosis-admin-token"
PROFILES = {
    "default": {"mode": "auto"},
    "forced-disagg": {"mode": "disagg"},
    "forced-local": {"mode": "local"},
    "tight": {"mode": "local", "deadline_s": 0.05},
    "beside": {"mode": "local", "max_local_prefill_tokens_while_decoding": 64},
    "spill": {"mode": "threshold", "min_remote_prefill_tokens": 32, "max_prefill_queue": 1},
}


def _config(model_dir: Path, token_file: Path) -> dict:
    return {
        "model": {"path": str(model_dir)},
        # a small KV pool: a handful of long sequences exhaust it
        "engine": {"num_kv_blocks": 128, "max_num_seqs": 8},
        "prefill": {"num_replicas": 1, "num_cpus": 0.25},
        "decode": {"num_replicas": 1, "num_cpus": 0.25},
        "router": {"num_cpus": 0, "prefill_timeout_s": 10.0},
        "transport": {"backend": "zmq", "host": "127.0.0.1"},
        "limits": {"default_max_tokens": 16, "max_tokens_limit": 512},
        "admission": {"max_concurrent_requests": 12, "max_queued_requests": 4, "queue_timeout_s": 30},
        "secrets": {"admin_token_file": str(token_file)},
        "workloads": PROFILES,
        "faults": {"enabled": True},  # test hooks on; no fault until a test sets one
    }


@pytest.fixture(scope="module")
def url(ray_cluster, tiny_model_dir, tmp_path_factory):
    from ray import serve

    from cluster.app import build_app

    token_file = tmp_path_factory.mktemp("secrets") / "admin"
    token_file.write_text(TOKEN)
    serve.run(build_app(_config(tiny_model_dir, token_file)), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{ray_cluster['http_port']}"
    wait_ok(base)
    yield base
    serve.delete(APP)


def _set_faults(spec: dict) -> None:
    from ray import serve

    serve.get_deployment_handle("PrefillWorker", APP).set_faults.remote(spec).result(timeout_s=30)


def _rows_file(tmp_path: Path, name: str, rows: list[dict]) -> Path:
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _run(url: str, out: Path, workload: str | list[dict], concurrency: int = 1, header_workload: str | None = None,
         **extra):
    """A closed-loop load test saving its metrics window; `workload` rows are sent once each."""
    from cluster.loadtest import LoadTestConfig, run_loadtest

    if isinstance(workload, list):
        extra["num_requests"] = len(workload)
        workload = str(_rows_file(out.parent, out.name + "-rows", workload))
    headers = {"x-workload": header_workload} if header_workload else {}
    config = LoadTestConfig(url=url, out_dir=out, workload=workload, concurrency=concurrency, headers=headers,
                            save_metrics=True, plots=False, timeout_s=120, **extra)
    return run_loadtest(config)


def _symptoms(url: str, run_dir: Path) -> dict[str, object]:
    findings = diagnose(collect(url, run_dir, token=TOKEN))
    return {f.symptom: f for f in findings}


def _queue_numbers(url: str, run_dir: Path) -> dict[str, object]:
    """What the queueing check read off a run's window, for a failure's message."""
    window = collect(url, run_dir, token=TOKEN).window
    return {"ttft": window.histogram("pdc_time_to_first_token_seconds"),
            "queue_by_stage": window.histogram_by("pdc_request_queue_seconds", "stage"),
            "routes": window.counter_by("pdc_route_decisions", "route")}


SHARED = "The quarterly report covers revenue, costs and outlook for every region in detail. " * 8


def test_a_healthy_run_names_nothing(url, tmp_path):
    _run(url, tmp_path / "ok", "chat-short", num_requests=10, header_workload="forced-local")
    found = _symptoms(url, tmp_path / "ok")
    # crowded-node is the test machine's verdict, not the deployment's: its engines share
    # two cores with the router, the proxy and the load tester, and wait for them when loaded
    found.pop("crowded-node", None)
    assert found == {}
    window = collect(url, tmp_path / "ok", token=TOKEN).window  # the run's own: its 10 requests, no probe
    assert window.counter("pdc_route_decisions") == 10


def test_dynamic_content_before_the_shared_prompt(url, tmp_path):
    first = [{"prompt": f"{i:06d} {time.time():.3f}"[:16].ljust(16) + SHARED, "output_len": 2} for i in range(12)]
    last = [{"prompt": SHARED + f" request {i:06d}", "output_len": 2} for i in range(12)]
    _run(url, tmp_path / "first", first, header_workload="forced-local")
    _run(url, tmp_path / "last", last, header_workload="forced-local")
    found = _symptoms(url, tmp_path / "first")
    assert "prefix-dynamic-first" in found, found
    assert found["prefix-dynamic-first"].numbers["prefix_block_share"] < 0.1
    assert "prefix-dynamic-first" not in _symptoms(url, tmp_path / "last")


def test_kv_pool_exhausted(url, tmp_path):
    rows = [{"prompt_len": 400, "output_len": 300} for _ in range(8)]
    _run(url, tmp_path / "kv", rows, concurrency=8, header_workload="forced-local")
    found = _symptoms(url, tmp_path / "kv")
    assert "kv-pressure" in found, found


def test_slow_link_makes_disaggregation_slower(url, tmp_path):
    rows = [{"prompt_len": 100, "output_len": 4, "workload": "forced-disagg" if i % 2 else "forced-local"}
            for i in range(16)]
    _set_faults({"kv_layer_delay_s": 0.2})  # 0.4 s a transfer: most of any TTFT, even on a busy CI box
    try:
        _run(url, tmp_path / "slow", rows)
    finally:
        _set_faults({"kv_transfer": "none"})
    found = _symptoms(url, tmp_path / "slow")
    for symptom in ("disagg-slower", "transfer-dominates-ttft", "short-prompts-disaggregated"):
        assert symptom in found, (symptom, found)


def test_long_prompts_prefilled_beside_streams(url, tmp_path):
    rows = [{"prompt_len": 200, "output_len": 24 + 8 * (i % 5)} for i in range(12)]
    _run(url, tmp_path / "beside", rows, concurrency=4,
         header_workload="beside")
    assert "long-prompts-beside-streams" in _symptoms(url, tmp_path / "beside")


def test_prefill_pool_saturated_while_decode_idles(url, tmp_path):
    rows = [{"prompt_len": 160, "output_len": 2} for _ in range(40)]  # few blocks: decode keeps room
    _run(url, tmp_path / "pf", rows, concurrency=8, header_workload="spill")
    assert "prefill-saturated" in _symptoms(url, tmp_path / "pf")


def test_decode_pool_saturated_and_queueing(url, tmp_path):
    rows = [{"prompt_len": 32, "output_len": 160} for _ in range(36)]  # more streams than max_num_seqs
    _run(url, tmp_path / "dec", rows, concurrency=12, header_workload="forced-local")
    found = _symptoms(url, tmp_path / "dec")
    assert "decode-saturated" in found, found
    assert "prefill-saturated" not in found
    # a third of the requests wait a whole stream for a slot: most of the mean TTFT is queue
    assert "queueing-dominates-ttft" in found, _queue_numbers(url, tmp_path / "dec")


def test_timeouts_and_429s(url, tmp_path):
    slow = [{"prompt_len": 300, "output_len": 64} for _ in range(6)]
    _run(url, tmp_path / "late", slow, header_workload="tight")
    found = _symptoms(url, tmp_path / "late")
    assert "timeouts" in found and found["timeouts"].numbers["by_tenant"], found
    burst = [{"prompt_len": 40, "output_len": 64} for _ in range(40)]
    _run(url, tmp_path / "burst", burst, concurrency=40,
         header_workload="forced-local")
    found = _symptoms(url, tmp_path / "burst")
    assert "rejections" in found, found
    assert found["rejections"].numbers["by_code"].get("server_overloaded"), found["rejections"]


def test_doctor_command_exit_codes(url, tmp_path):
    from typer.testing import CliRunner

    from cluster.cli import app

    runner = CliRunner()
    ok = runner.invoke(app, ["doctor", "--url", url, "--window", "1", "--json"], env={"PDC_ADMIN_TOKEN": TOKEN})
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["status"] == "ok"
    missing = runner.invoke(app, ["doctor", "--url", url, "--run", str(tmp_path / "none"), "--window", "1",
                                  "--json"])
    assert missing.exit_code == 0 and "not read" in json.loads(missing.output)["notes"][0]
    down = runner.invoke(app, ["doctor", "--url", "http://127.0.0.1:9", "--window", "1"])
    assert down.exit_code == 2 and "cannot reach" in down.output


# ---- experiment -------------------------------------------------------------------------------


def _admin(url: str) -> dict:
    return httpx.get(f"{url}/admin/workloads", headers={"authorization": f"Bearer {TOKEN}"}, timeout=10).json()


def _spec(url: str, **over) -> dict:
    spec = {
        "name": "e2e", "url": url, "workloads": [{"name": "exp-chat", "load": "chat-short"}],
        "rate": 6, "num_requests": 6, "repeats": 2, "slo": {"ttft_ms": 2000, "tpot_ms": 500}, "plots": True,
        "variants": [{"name": "local", "profile": {"mode": "local"}},
                     {"name": "chat-endpoint", "client": {"endpoint": "chat"}}],
        "samples": [{"id": "capital", "prompt": "The capital of France is", "max_tokens": 6},
                    {"id": "story", "prompt": "Once upon a time", "max_tokens": 6, "checks": {"regex": ".+"}},
                    {"id": "json", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 4,
                     "checks": {"json": True}}],
        "bootstrap_resamples": 200,
    }
    spec.update(over)
    return spec


def test_experiment_end_to_end(url, tmp_path):
    from typer.testing import CliRunner

    from cluster.cli import app

    before = _admin(url)
    file = tmp_path / "exp.yaml"
    file.write_text(yaml.safe_dump(_spec(url)))
    out = tmp_path / "out"
    runner = CliRunner()
    dry = runner.invoke(app, ["experiment", str(file), "--dry-run"], env={"PDC_ADMIN_TOKEN": TOKEN})
    assert dry.exit_code == 0 and "6 runs" in dry.output and not out.exists()
    assert _admin(url)["version"] == before["version"]
    result = runner.invoke(app, ["experiment", str(file), "--out", str(out)], env={"PDC_ADMIN_TOKEN": TOKEN})
    assert result.exit_code == 0, result.output
    after = _admin(url)
    assert after["workloads"] == before["workloads"] and after["version"] > before["version"]

    report = json.loads((out / "report.json").read_text())
    order = [(r["repeat"], r["variant"]) for r in report["runs"]]
    assert order == [(1, "baseline"), (1, "local"), (1, "chat-endpoint"),
                     (2, "baseline"), (2, "local"), (2, "chat-endpoint")]
    found = report["workloads"]["exp-chat"]
    quality = found["quality"]
    assert quality["local"]["identical"] == quality["local"]["compared"] == 6  # a route change: same tokens
    assert quality["chat-endpoint"]["different"] > 0  # a chat template: a different prompt, flagged
    assert quality["baseline"]["check_pass_rate"]["regex"] == 1.0
    assert set(found["comparisons"]["local"]) >= {"ttft_p50_ms", "goodput_fraction", "error_fraction"}
    assert found["arms"]["local"]["routes"] == {"local": 12}
    assert found["recommendation"]["decision"]
    markdown = (out / "report.md").read_text()
    assert "WARNING: chat-endpoint changed" in markdown and "## Audit trail" in markdown
    for name in ("runs.csv", "bars-exp-chat.png", "cdf-exp-chat.png", "journal.jsonl"):
        assert (out / name).exists(), name
    events = [r["event"] for r in report["audit"]]
    assert events.count("applied") == 2 and events.count("restored") >= 2
    run_dirs = sorted((out / "runs").iterdir())
    assert len(run_dirs) == 6 and all((d / "metrics_end.prom").exists() for d in run_dirs)
    salts = {json.loads((d / "summary.json").read_text())["env"]["prompt_salt"] for d in run_dirs}
    assert len(salts) == 6  # fresh prompt bytes for every run


def _start_and_stop(url: str, tmp_path: Path, sig: int) -> tuple[Path, int]:
    """Start an experiment in a process, send `sig` while its variant is applied; its out
    folder and exit code."""
    file = tmp_path / "exp.yaml"
    spec = _spec(url, samples=[], repeats=3, num_requests=12, rate=3,
                 variants=[{"name": "disagg", "profile": {"mode": "disagg", "min_remote_prefill_tokens": 0},
                            "multiple_changes": True}])
    file.write_text(yaml.safe_dump(spec))
    out = tmp_path / "stopped"
    # SIGINT as a terminal delivers it, even where this suite runs as a background job
    # (which inherits SIGINT ignored, and so would its child: Ctrl-C would never arrive)
    proc = subprocess.Popen([sys.executable, "-m", "cluster", "experiment", str(file), "--out", str(out)],
                            env={**os.environ, "PDC_ADMIN_TOKEN": TOKEN}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            journal = out / "journal.jsonl"
            if journal.exists() and '"event": "applied"' in journal.read_text():
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the experiment never applied its variant")
    finally:
        proc.send_signal(sig)
        code = proc.wait(timeout=60)
    return out, code


def test_ctrl_c_restores_and_reports_the_runs_so_far(url, tmp_path):
    before = _admin(url)
    out, code = _start_and_stop(url, tmp_path, signal.SIGINT)
    assert code == 1
    after = _admin(url)
    assert after["workloads"] == before["workloads"] and after["version"] > before["version"]
    report = json.loads((out / "report.json").read_text())
    assert "KeyboardInterrupt" in report["stopped"] and report["runs"]
    assert [r["event"] for r in report["audit"]][-2:] == ["stopped", "restored"]


def test_rollback_after_the_process_is_killed(url, tmp_path):
    before = _admin(url)
    out, _ = _start_and_stop(url, tmp_path, signal.SIGKILL)
    changed = _admin(url)
    assert changed["workloads"]["exp-chat"]["mode"] == "disagg"  # killed mid-run: still changed

    from typer.testing import CliRunner

    from cluster.cli import app

    result = CliRunner().invoke(app, ["experiment", "--rollback", str(out)], env={"PDC_ADMIN_TOKEN": TOKEN})
    assert result.exit_code == 0, result.output
    assert "restored" in result.output
    after = _admin(url)
    assert after["workloads"] == before["workloads"] and after["version"] > changed["version"]
