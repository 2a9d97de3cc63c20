"""Smoke test of `pdcluster bench transport --json`: tiny sizes, JSON alone on stdout."""

from __future__ import annotations

import json
import subprocess
import sys


def test_bench_transport_prints_json():
    proc = subprocess.run(
        [sys.executable, "-m", "cluster", "bench", "transport", "--json", "--sizes", "1",
         "--repeats", "1", "--no-ray", "--no-curve", "--no-overlap"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout)
    names = {r["name"] for r in out["results"]}
    assert {"zmq", "zmq_inline", "nccl", "shm", "raw_tcp", "memcpy"} <= names
    assert all(r["gb_per_s"] > 0 for r in out["results"])
    assert "zmq_vs_raw_tcp_1MiB" in out["ratios"]
    assert out["ratios_paired"]["zmq_vs_raw_tcp_1MiB"] > 0  # median of per-round ratios
