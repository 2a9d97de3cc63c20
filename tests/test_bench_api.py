"""`pdcluster bench api` on the tiny model with a few requests: the JSON report has the
documented shape, every ratio is a positive number and `n: 4` computes each prompt once."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cluster.bench.api import CONFIGS, ApiBenchConfig, run_benchmark
from cluster.cli import app


def test_bench_api_reports_every_configuration_and_n4_prefills_once(tmp_path):
    cfg = ApiBenchConfig(preset="tiny", num_requests=3, repeats=1, prompt_len_range=(32, 64),
                         output_len_range=(16, 24), model_cache=tmp_path)
    report = run_benchmark(cfg)
    assert list(report["results"]) == list(CONFIGS)
    for r in report["results"].values():
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0 and r["num_preemptions"] == 0
    results = report["results"]
    assert results["n4"]["num_generated_tokens"] == 4 * results["plain"]["num_generated_tokens"]
    assert results["json_schema"]["num_cut_at_max_tokens"] == 0  # bounded schema: every object closes
    assert set(report["ratios"]) == {"logprobs_vs_plain", "penalties_vs_plain", "n4_vs_plain",
                                     "json_schema_vs_plain"}
    assert all(isinstance(v, float) and v > 0 for v in report["ratios"].values())
    assert set(report["cpu_time_ratios"]) == set(report["ratios"])
    assert all(isinstance(v, float) and v > 0 for v in report["cpu_time_ratios"].values())
    assert set(report["targets"]) == {"logprobs_vs_plain", "penalties_vs_plain", "json_schema_vs_plain",
                                      "n4_prefills_once"}
    assert all(set(t) == {"value", "limit", "met"} for t in report["targets"].values())
    n4 = report["targets"]["n4_prefills_once"]
    assert n4["met"] and n4["value"] == results["plain"]["num_prompt_tokens_computed"] > 0
    assert report["setup"]["preset"] == "tiny" and report["machine"]["cores"] >= 1


def test_bench_api_cli_prints_json_alone_on_stdout(tmp_path):
    args = ["bench", "api", "--json", "--preset", "tiny", "--num-requests", "2", "--repeats", "1",
            "--max-prompt-len", "40", "--max-output-len", "16", "--threads", "1", "--model-cache", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["bench"] == "api" and report["targets"]["n4_prefills_once"]["met"]
