"""Prefill and decode pools on different Ray nodes (several raylets on this machine,
`ray.cluster_utils.Cluster`), placed by the custom resources `prefill` / `decode`, with
the KV crossing between them over TCP. Runs in a subprocess with its own Ray cluster, so
it never collides with the session's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import _free_port

ROOT = Path(__file__).resolve().parent.parent


def test_pools_on_different_nodes_kv_over_tcp(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "tests.multinode_app", str(tiny_model_dir), str(_free_port())],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1])
    assert result["nodes"]["prefill"] == result["prefill_node"]
    assert result["nodes"]["decode"] == result["decode_node"]
    local, disagg = result["outs"]["local"], result["outs"]["disagg"]
    assert local["status"] == disagg["status"] == 200
    assert (local["route"], disagg["route"]) == ("local", "disagg")
    assert local["token_ids"] == disagg["token_ids"]
    assert result["transfer_bytes"] > 0
