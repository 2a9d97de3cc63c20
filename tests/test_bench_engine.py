"""`pdcluster bench engine` end to end on the tiny model with a handful of requests: the
three runners agree token for token and the JSON report has the documented shape."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cluster.bench.engine import BenchConfig, make_workload
from cluster.cli import app


def test_workload_is_seeded_and_in_range():
    cfg = BenchConfig(num_requests=48)
    workload = make_workload(cfg)
    assert workload == make_workload(cfg)
    assert all(32 <= len(p) <= 512 for p in workload.prompts)
    assert all(16 <= n <= 128 for n in workload.output_lens)
    assert all(0 <= t < 256 for p in workload.prompts for t in p)


def test_bench_engine_cli_prints_json_with_matching_tokens(tmp_path):
    args = ["bench", "engine", "--json", "--preset", "tiny", "--num-requests", "5",
            "--max-prompt-len", "60", "--max-output-len", "20", "--batch-sizes", "2,4",
            "--threads", "1", "--model-cache", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout carries the JSON alone
    assert [r["name"] for r in report["results"]] == [
        "pdcluster", "hf_generate", "hf_continuous_batching"]
    assert all(r["tokens_per_s"] > 0 and r["wall_s"] > 0 for r in report["results"])
    assert set(report["ratios"]) == {"vs_hf_generate", "vs_hf_continuous_batching"}
    assert report["identical_tokens"], report["mismatches"]
    assert report["results"][1]["batch_size"] in (2, 4)
