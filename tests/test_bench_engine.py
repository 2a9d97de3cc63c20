"""`pdcluster bench engine` end to end on the tiny model with a handful of requests: the
three runners agree token for token and the JSON report has the documented shape, with
the engine against the machine's limits; the classifiers of mismatches (near tie or
real) on synthetic logits and logprobs."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from cluster.bench.engine import BenchConfig, make_workload
from cluster.bench.engine_mismatches import (
    classify_by_logprobs,
    classify_divergence,
    classify_mismatches,
    is_logprob_tie,
)
from cluster.cli import app
from workers.engine.sequence import TokenLogprob


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
            "--threads", "1", "--model-cache", str(tmp_path), "--decode-batches", "1,2",
            "--decode-contexts", "32,64"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)  # stdout carries the JSON alone
    assert [r["name"] for r in report["results"]] == [
        "pdcluster", "hf_generate", "hf_continuous_batching"]
    assert all(r["tokens_per_s"] > 0 and r["wall_s"] > 0 for r in report["results"])
    shapes = [f"b{b}_ctx{c}" for b in (1, 2) for c in (32, 64)]
    assert set(report["ratios"]) == {"vs_hf_generate", "vs_hf_continuous_batching", "prefill_vs_bare_matmul",
                                     *(f"decode_vs_read_floor_{s}" for s in shapes)}
    assert all(r > 0 for r in report["ratios"].values())
    limits = report["limits"]
    assert limits["bare_matmul"]["num_linear_layers"] == 2 * 7 + 1  # q k v o gate up down per layer, lm_head
    assert limits["read_bandwidth"]["bytes_per_s"] > 0 and "sum" in limits["read_bandwidth"]["how"]
    assert set(limits["engine_decode"]) == set(shapes)
    decode = limits["engine_decode"]["b2_ctx64"]
    assert decode["floor_s"] < decode["step_s"] and decode["vs_floor"] == report["ratios"]["decode_vs_read_floor_b2_ctx64"]
    assert report["identical_tokens"], report["mismatches"]
    assert report["identical_or_near_tie"]
    # With no mismatch, the engine is not rerun for its logprobs.
    assert report["mismatches"] == {"near_tie": 0, "real": 0, "examples": [], "by_engine_logprobs": None}
    assert report["results"][1]["batch_size"] in (2, 4)


def test_divergence_within_the_gap_is_a_near_tie_else_real():
    logits = torch.tensor([0.0, 5.0, 5.0 - 5e-5, 4.0])
    tie = classify_divergence(logits, 2, 1)
    assert tie["kind"] == "near_tie" and abs(tie["logit_gap"] - 5e-5) < 1e-6
    real = classify_divergence(logits, 1, 3)
    assert real["kind"] == "real" and abs(real["logit_gap"] - 1.0) < 1e-6


def test_mismatches_are_counted_by_kind_at_the_first_differing_token():
    prompts = [[7, 8], [9]]
    reference = [[1, 2, 3], [1, 1]]
    others = {"a": [[1, 2, 2], [3, 1]], "b": [[1, 2], [1, 1]]}  # b: shorter, no differing token
    found = {"a": [{"request": 0, "first_diff_at": 2, "len": [3, 3]},
                   {"request": 1, "first_diff_at": 0, "len": [2, 2]}],
             "b": [{"request": 0, "first_diff_at": 2, "len": [3, 2]}]}
    seen = []

    def next_logits(token_ids):  # request 0 parts at a near tie of tokens 2 and 3, request 1 clearly
        seen.append(token_ids)
        return torch.tensor([0.0, 1.0, 3.0, 3.0 - 2e-5]) if token_ids[0] == 7 else torch.tensor([0.0, 2.0, 0.0, 1.0])

    out = classify_mismatches(found, reference, others, prompts, next_logits)
    assert (out["near_tie"], out["real"]) == (1, 2)
    assert seen == [[7, 8, 1, 2], [9]]  # the prompt plus the shared output up to the first difference
    assert [(e["runner"], e["kind"]) for e in out["examples"]] == [("a", "near_tie"), ("a", "real"), ("b", "real")]
    assert out["examples"][0]["tokens"] == [3, 2] and out["examples"][2]["logit_gap"] is None


def test_a_logprob_tie_is_the_engines_top_two_within_the_gap_holding_the_other_token():
    tie = TokenLogprob(5, -0.6930, ((5, -0.6930), (9, -0.6935), (2, -3.0)))
    assert is_logprob_tie(tie, 9)
    assert not is_logprob_tie(tie, 2)  # the other runner's token is not the runner-up
    assert not is_logprob_tie(TokenLogprob(5, -0.1, ((5, -0.1), (9, -2.5))), 9)
    assert not is_logprob_tie(TokenLogprob(5, -0.1, ((5, -0.1),)), 9)  # no runner-up to compare


def test_mismatches_are_counted_by_the_engines_logprobs_at_the_first_differing_token():
    reference = [[1, 2, 3], [4, 4]]
    others = {"a": [[1, 2, 7], [8, 4]], "b": [[1, 2], [4, 4]]}
    found = {"a": [{"request": 0, "first_diff_at": 2, "len": [3, 3]},
                   {"request": 1, "first_diff_at": 0, "len": [2, 2]}],
             "b": [{"request": 0, "first_diff_at": 2, "len": [3, 2]}]}  # b: shorter, no differing token
    close, clear = ((3, -0.69), (7, -0.6905)), ((4, -0.01), (8, -5.0))
    logprobs = [[TokenLogprob(1, -0.1), TokenLogprob(2, -0.1), TokenLogprob(3, -0.69, close)],
                [TokenLogprob(4, -0.01, clear), TokenLogprob(4, -0.01, clear)]]
    assert classify_by_logprobs(found, reference, others, logprobs) == {"near_tie": 1, "real": 2}
