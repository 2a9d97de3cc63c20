"""`pdcluster demo --quick` on the tiny model, in its own process (its own local Ray):
three modes run, the table prints, the PNGs are written, Serve and Ray stop cleanly."""

from __future__ import annotations

import json
import subprocess
import sys


def test_demo_quick_runs_three_modes_and_stops_cleanly(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "cluster", "demo", "--quick", "--preset", "tiny",
         "--model-cache", str(tmp_path / "models"), "--out", str(out)],
        capture_output=True, text=True, timeout=420, env=_wide_terminal())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "clean stop" in proc.stdout, proc.stdout[-3000:]
    for label in ("ttft p50 (ms)", "itl p99 (ms)", "goodput (req/s)", "short itl p99"):
        assert label in proc.stdout
    for png in ("metrics.png", "latency_cdf.png"):
        assert (out / "compare" / png).stat().st_size > 0
    result = json.loads((out / "compare" / "compare.json").read_text())
    assert result["runs"] == ["local", "disagg", "auto"]
    rows = {r["metric"]: r["values"] for r in result["rows"]}
    assert rows["failed"] == [0, 0, 0]
    assert rows["routes disagg"][0] == 0 and rows["routes local"][1] == 0


def _wide_terminal() -> dict:
    import os

    return {**os.environ, "COLUMNS": "160"}
