"""The engine's per-step phase stamps (`LLMEngine.step_phases`), the fixed-shape steps the
bench times, and `pdcluster bench engine --profile`, on the real tiny model."""

from __future__ import annotations

import json
import math

import torch
from typer.testing import CliRunner

from cluster.bench.engine_limits import (
    bare_matmul,
    decode_floor_s,
    linear_weights,
    read_bandwidth,
    weight_bytes,
)
from cluster.bench.engine_profile import PHASES, phase_split
from cluster.bench.engine_shapes import shape_engine, time_decode, time_prefill
from cluster.cli import app
from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine.step_cost import ForwardTimer


def test_every_step_splits_into_phases_that_sum_to_its_recorded_time(make_engine):
    engine = make_engine(max_num_batched_tokens=64)
    for i, prompt in enumerate(random_prompts([100, 20, 5])):
        engine.add_request(f"r{i}", prompt, greedy(6, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.step_phases) == len(engine.step_records) > 3
    for record, phases in zip(engine.step_records, engine.step_phases, strict=True):
        assert math.isclose(phases.step_s, record.step_time_s, rel_tol=1e-9, abs_tol=1e-12)
        assert min(phases.schedule_s, phases.run_s, phases.sample_s, phases.output_s) >= 0
        assert phases.forward_s is not None and 0 < phases.forward_s <= phases.run_s
        assert phases.metadata_s == phases.run_s - phases.forward_s


def test_forward_timer_reports_a_forward_once_and_none_without_one():
    module = torch.nn.Linear(4, 4)
    timer = ForwardTimer(module)
    assert timer.take() is None
    module(torch.ones(1, 4))
    elapsed = timer.take()
    assert elapsed is not None and elapsed > 0
    assert timer.take() is None


def test_fixed_shape_steps_decode_the_whole_batch_and_leave_the_engine_clean(tiny_model_dir):
    engine = shape_engine(str(tiny_model_dir), 4 * 64, chunk_tokens=128)
    decode = time_decode(engine, batch=4, context=64, num_steps=3)
    assert len(decode.phases) == len(decode.call_s) == 3 and decode.step_s > 0
    prefill = time_prefill(engine, chunk_tokens=128, num_steps=2)
    assert len(prefill.phases) == 2
    records = list(engine.step_records)
    assert sum(r.num_decode_seqs == 4 and not r.num_prefill_tokens for r in records) >= 4
    assert sum(r.num_prefill_tokens == 128 and not r.num_decode_seqs for r in records) == 3
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_phase_split_shares_cover_the_step_call(tiny_model_dir):
    engine = shape_engine(str(tiny_model_dir), 2 * 32, chunk_tokens=64)
    split = phase_split(time_decode(engine, batch=2, context=32, num_steps=3))
    assert list(split["phases"]) == list(PHASES) and split["forward_timed_apart"]
    assert math.isclose(sum(p["share"] for p in split["phases"].values()), 1.0, abs_tol=1e-3)
    assert math.isclose(split["outside_forward"], 1 - split["phases"]["forward"]["share"], abs_tol=1e-3)


def test_limits_count_the_models_own_weights():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    model.get_input_embeddings = lambda: model[0]
    model.get_output_embeddings = lambda: model[2]
    assert [w.shape for _, w in linear_weights(model)] == [(16, 8), (8, 16)]
    assert weight_bytes(model) == 4 * (16 * 8 + 16 + 8 * 16 + 8)  # the embedding table is not read whole
    bare = bare_matmul(model, chunk_tokens=32, num_repeats=2)
    assert bare["tokens_per_s"] > 0 and bare["num_linear_layers"] == 2
    assert read_bandwidth(1 << 20, num_repeats=2)["bytes_per_s"] > 0
    assert decode_floor_s(1000, 10, batch=2, context=50, bytes_per_s=1000.0) == 2.0


def test_bench_engine_profile_prints_the_split_per_shape(tmp_path):
    args = ["bench", "engine", "--profile", "--json", "--preset", "tiny", "--threads", "1",
            "--decode-batches", "1,2", "--profile-context", "32", "--model-cache", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert list(report["profile"]) == ["decode_b1_ctx32", "decode_b2_ctx32", "prefill_1024"]
    assert all(set(s["phases"]) == set(PHASES) for s in report["profile"].values())
    assert report["workload"] == {"preset": "tiny", "decode_context": 32, "chunk_tokens": 1024, "detokenize": True}
