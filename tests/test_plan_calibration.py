"""`pdcluster plan calibrate` without a deployment: the fit through the calibration path
on synthetic records of known cost, the held-out split, run folders on disk, the offline
sweep of the real engine on the tiny model, the cached default, and the CLI."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

from cluster.cli import app
from cluster.loadtest.client import RequestRecord
from cluster.loadtest.report import _ms_row
from cluster.plan.calibrate import CalibrationError, Overrides, from_records, from_runs
from cluster.plan.calibration import Calibration
from cluster.plan.fit import HOLD_OUT_EVERY, fit_and_score, same_shape_spread, split_held_out
from cluster.plan.overhead import engine_ttft_s
from cluster.plan.records import (
    RecordSet,
    ReplicaStep,
    ReplicaTransfer,
    read_run_records,
    write_run_records,
)
from transport.transfer_record import TransferRecord
from workers.engine.step_cost import StepRecord

TRUE = (0.002, 4e-6, 2e-9, 5e-5, 3e-7)  # c0..c4, seconds per unit


def _record(rng: random.Random, at: float, noise: float = 0.01) -> StepRecord:
    """A step of random work whose time is the model's at TRUE, times (1 +- noise)."""
    prefill = rng.choice([0, 0, rng.randrange(1, 1024)])
    start = rng.randrange(0, 2048) if prefill else 0
    decode_seqs = rng.choice([0, rng.randrange(1, 64)]) if prefill else rng.randrange(1, 64)
    decode_context = decode_seqs * rng.randrange(32, 2048)
    work = prefill * (start + prefill)
    seconds = float(np.dot(TRUE, [1, prefill, work, decode_seqs, decode_context])) * (1 + rng.uniform(-noise, noise))
    return StepRecord(start_time=at, step_time_s=seconds, num_prefill_tokens=prefill, num_decode_seqs=decode_seqs,
                      num_context_tokens=decode_context + (start + prefill if prefill else 0), num_running=1,
                      num_waiting=0, num_prefill_seqs=1 if prefill else 0, prefill_attention_work=work)


def _steps(n: int, seed: int = 0, replicas: tuple[str, ...] = ("d0", "p0")) -> list[ReplicaStep]:
    rng = random.Random(seed)
    return [ReplicaStep(replicas[i % len(replicas)], "decode", _record(rng, 1000.0 + i)) for i in range(n)]


def test_the_fit_recovers_known_coefficients_and_scores_held_out_records():
    step, quality = fit_and_score(_steps(400))
    got = [step.fixed_s, step.prefill_token_s, step.prefill_attention_s, step.decode_seq_s, step.decode_context_s]
    assert np.allclose(got, TRUE, rtol=0.05), got
    assert quality.median_relative_error < 0.01 and quality.p90_relative_error < 0.02
    assert quality.num_held_out == 400 // HOLD_OUT_EVERY and quality.num_fitted == 400 - quality.num_held_out


def _contended_steps(kappa: float) -> list[ReplicaStep]:
    rng = random.Random(7)
    steps = []
    for s in _steps(400, seed=3):
        busy = rng.choice([0.0, 1.0, 2.0])
        slowed = dataclasses.replace(s.record, step_time_s=s.record.step_time_s * (1 + kappa * busy), node_busy=busy)
        steps.append(dataclasses.replace(s, record=slowed))
    return steps


def test_the_fit_recovers_the_node_contention_and_the_model_carries_it():
    step, quality = fit_and_score(_contended_steps(0.45))
    assert step.node_contention == pytest.approx(0.45)
    got = [step.fixed_s, step.prefill_token_s, step.prefill_attention_s, step.decode_seq_s, step.decode_context_s]
    assert np.allclose(got, TRUE, rtol=0.05), got
    assert quality.median_relative_error < 0.01
    assert step.coefficients().node_contention == pytest.approx(0.45)


def test_a_calibration_fits_the_node_contention_only_when_asked(tiny_model_dir):
    records = RecordSet(_contended_steps(0.45))
    plain = from_records(records, "run", Overrides(model_dir=str(tiny_model_dir)), "test")
    assert plain.step.node_contention == 0.0 and plain.reported_step.node_contention == 0.0
    assert "node contention not fitted" in plain.notes
    fitted = from_records(records, "run", Overrides(model_dir=str(tiny_model_dir), node_contention=True), "test")
    assert fitted.step.node_contention == pytest.approx(0.45)
    assert fitted.reported_step.node_contention == pytest.approx(0.45)
    assert fitted.quality.median_relative_error < plain.quality.median_relative_error


def test_records_with_cpu_time_score_the_work_apart_from_the_wait_for_a_core():
    """Steps that waited U(0, 60%) of their work for a core: the wall-time error shows
    that scatter, the work alone (CPU time) is predicted as closely as it was measured,
    and the mean wait is reported; the model predicts the mean wall time."""
    rng = random.Random(5)
    steps = []
    for s in _steps(400, seed=4):
        wait = s.record.step_time_s * rng.uniform(0.0, 0.6)
        record = dataclasses.replace(s.record, cpu_time_s=s.record.step_time_s, run_wait_s=wait,
                                     step_time_s=s.record.step_time_s + wait)
        steps.append(dataclasses.replace(s, record=record))
    step, quality = fit_and_score(steps)
    assert quality.work_median_relative_error < 0.01
    assert quality.run_wait_share == pytest.approx(0.3, abs=0.05)
    assert quality.median_relative_error > 0.05  # the wait's scatter, which no feature of the step explains
    got = [step.fixed_s, step.prefill_token_s, step.prefill_attention_s, step.decode_seq_s, step.decode_context_s]
    assert np.allclose(got, np.array(TRUE) * 1.3, rtol=0.08), got
    assert fit_and_score(_steps(400))[1].work_median_relative_error is None  # no CPU time, no work score


def test_steps_alike_scatter_is_the_floor_no_step_model_can_beat():
    """Six shapes, each run 20 times with its wall time at 1, 1.5 or 2 times its work (a
    core free, half free, taken): a step model sees each shape as one point. The median
    error is least at c = 12/7 of the work, where the middle and the slow steps are both
    1/7 off; a shape seen fewer than five times does not count."""
    steps = []
    for shape in range(6):
        for i in range(20):
            r = StepRecord(start_time=float(len(steps)), step_time_s=0.01 * (1 + shape) * (1.0, 1.5, 2.0)[i % 3],
                           num_prefill_tokens=0, num_decode_seqs=1 + shape, num_context_tokens=100 * (1 + shape),
                           num_running=1 + shape, num_waiting=0)
            steps.append(ReplicaStep("d0", "decode", r))
    lone = StepRecord(start_time=999.0, step_time_s=0.05, num_prefill_tokens=64, num_decode_seqs=0,
                      num_context_tokens=64, num_running=1, num_waiting=0)
    random.Random(5).shuffle(steps)
    spread, share = same_shape_spread([*steps, ReplicaStep("d0", "decode", lone)])
    assert spread == pytest.approx(1 / 7, abs=0.005) and share == pytest.approx(120 / 121)
    assert fit_and_score(steps)[1].same_shape_spread == pytest.approx(spread)
    assert same_shape_spread(steps[:4]) == (None, None)


def test_held_out_records_are_never_fitted():
    steps = _steps(200)
    fitted, held_out = split_held_out(steps)
    assert len(held_out) == 200 // HOLD_OUT_EVERY and not {id(s) for s in fitted} & {id(s) for s in held_out}
    # every held-out record 10x slower: the fit must not move, the score must show it
    slow = {id(s.record) for s in held_out}
    corrupted = [ReplicaStep(s.replica_id, s.role, _scaled(s.record, 10.0) if id(s.record) in slow else s.record)
                 for s in steps]
    clean_step, clean_quality = fit_and_score(steps)
    step, quality = fit_and_score(corrupted)
    assert step == clean_step
    assert quality.median_relative_error > 0.85 > clean_quality.median_relative_error


def _scaled(r: StepRecord, factor: float) -> StepRecord:
    return StepRecord(**{**r.__dict__, "step_time_s": r.step_time_s * factor})


def _transfers(n: int) -> list[ReplicaTransfer]:
    """Tails of 1 ms + bytes at 2 GB/s."""
    out = []
    for i in range(n):
        num_bytes = 4096 * (i + 1)
        out.append(ReplicaTransfer("p0", "prefill", TransferRecord(f"t{i}", num_bytes, 2, "tcp", 1000.0 + i,
                                                                  0.05, 0.001 + num_bytes / 2e9, "d0")))
    return out


def _run_dir(tmp_path, with_requests: bool = True):
    records = RecordSet(_steps(300), _transfers(20), {
        "engine": {"block_size": 16, "max_num_seqs": 24, "model": "served-tiny", "device": "cpu", "dtype": "float32"},
        "replicas": {"d0": {"role": "decode", "kv_blocks_total": 777, "max_num_batched_tokens": 512,
                            "kv_bytes_per_token": 512}}})
    write_run_records(tmp_path, records)
    if with_requests:  # requests one after another, each 7 ms slower than the engine: the overhead
        step, _ = fit_and_score(records.steps)
        from cluster.plan.fit import fit_transfers

        transfer, _ = fit_transfers(records.transfers)
        rows, at = [], 0.0
        for i in range(12):
            route, prompt_len = ("disagg", "local")[i % 2], 100 + 50 * i
            ttft = engine_ttft_s(prompt_len, route, step, transfer, 512, 512) + 0.007
            rows.append(RequestRecord(i, f"r{i}", "w", None, sent_at_s=at, ended_at_s=at + ttft + 0.05, ttft_s=ttft,
                                      e2e_s=ttft + 0.05, route=route, prompt_tokens=prompt_len))
            at += ttft + 0.05  # the next is sent as this one ends: none overlaps another
        (tmp_path / "requests.jsonl").write_text("".join(json.dumps(_ms_row(r)) + "\n" for r in rows))
    return records


def test_a_run_folder_round_trips_and_calibrates_from_its_own_report(tmp_path):
    records = _run_dir(tmp_path)
    back = read_run_records(tmp_path)
    def key(s):
        return s.record.start_time
    assert [(s.replica_id, s.role, s.record) for s in sorted(back.steps, key=key)] == [
        (s.replica_id, s.role, s.record) for s in sorted(records.steps, key=key)]  # the node rate is read's own
    assert [t.record for t in back.transfers] == [t.record for t in records.transfers]
    c = from_runs([tmp_path])
    assert (c.source, c.model, c.device, c.dtype) == ("run", "served-tiny", "cpu", "float32")
    assert c.limits.model_dump() == {"block_size": 16, "num_kv_blocks": 777, "max_num_seqs": 24,
                                     "max_num_batched_tokens": 512, "enable_prefix_caching": True,
                                     "kv_bytes_per_token": 512, "num_layers": 2}
    assert c.transfer.num_samples == 20 and c.transfer.bytes_per_s == pytest.approx(2e9, rel=0.02)
    assert c.transfer.fixed_s == pytest.approx(0.001, rel=0.02) and c.transfer.path == "tcp"
    assert c.request_overhead_s == pytest.approx(0.007, abs=1e-4)
    assert c.quality.num_held_out == 300 // HOLD_OUT_EVERY and "assumed" not in c.notes
    assert Calibration.load(c.save(tmp_path / "cal.json")) == c
    # what the replicas report is their own (relative-error) fit of the same steps; on
    # these records (uniform noise about a linear truth) both fits find the truth
    assert c.reported_step is not None and c.reported_step.num_samples == c.step.num_samples
    assert np.allclose(c.reported_step.coefficients().vector(), c.step.coefficients().vector(), rtol=0.05)


def test_what_the_records_do_not_say_comes_from_the_caller_and_is_named(tmp_path, tiny_model_dir):
    records = RecordSet(_steps(100))
    with pytest.raises(CalibrationError, match="--model"):
        from_records(records, "run", Overrides(), "test")
    c = from_records(records, "run", Overrides(model_dir=str(tiny_model_dir), max_num_seqs=8), "test")
    assert (c.model, c.limits.num_layers, c.limits.kv_bytes_per_token, c.limits.max_num_seqs) == ("tiny", 2, 512, 8)
    assert "assumed" in c.notes and "device=unknown" in c.notes and c.request_overhead_s == 0
    with pytest.raises(CalibrationError, match="no step records"):
        from_records(RecordSet(), "run", Overrides(), "test")


def test_the_sweep_runs_the_real_engine_and_writes_what_it_ran_on(tiny_model_dir, tmp_path):
    from cluster.plan.sweep_source import from_sweep

    seen = []
    c = from_sweep(tiny_model_dir, "cpu", "float32", max_points=6, on_point=lambda done, total: seen.append(total))
    assert (c.source, c.model, c.device, c.dtype) == ("sweep", "tiny", "cpu", "float32")
    assert seen == [36] * 36 and c.quality.num_held_out >= 10  # 6 points, an unrecorded pass and 5 recorded and c.quality.num_fitted >= 4 * c.quality.num_held_out - 4
    assert c.step.num_samples == c.quality.num_fitted and c.step.fixed_s > 0
    assert c.limits.kv_bytes_per_token == 512 and c.limits.num_layers == 2 and c.request_overhead_s == 0
    assert c.quality.median_relative_error < 1.0  # a sanity bound; the figure itself is reported, not asserted
    assert Calibration.load(c.save(tmp_path / "c.json")) == c


def test_the_default_calibration_sweeps_once_then_reads_its_cache(tmp_path, monkeypatch, tiny_model_dir):
    from cluster.plan.default import (
        cache_key,
        cache_path,
        default_calibration,
        default_calibration_file,
    )

    monkeypatch.setenv("PDC_CACHE_DIR", str(tmp_path))
    shutil.copytree(tiny_model_dir, tmp_path / "tiny-seed0")  # the embedded preset, as made on first use
    first = default_calibration(max_points=4)
    path = default_calibration_file(max_points=4)
    assert default_calibration(max_points=4) == first and path.parent.parent == tmp_path
    assert first.model == "tiny-seed0" and first.device == "cpu" and "1 torch thread" in first.notes
    key = cache_key("tiny", 0, "cpu", "float32", 1, 4)
    assert cache_path(key) == path
    for change in ({"torch_threads": 2}, {"dtype": "bfloat16"}, {"engine_source": "0"}, {"device": "cuda"}):
        assert cache_path({**key, **change}) != path


def test_the_cli_calibrates_from_a_sweep_and_from_a_run(tiny_model_dir, tmp_path):
    runner = CliRunner()
    out = tmp_path / "sweep.json"
    result = runner.invoke(app, ["plan", "calibrate", "--model", str(tiny_model_dir), "--max-points", "4",
                                 "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout.strip().splitlines()[-1])
    assert printed["path"] == str(out) and Calibration.load(out).device == "cpu"
    _run_dir(tmp_path / "run")
    result = runner.invoke(app, ["plan", "calibrate", "--run", str(tmp_path / "run"), "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert "held-out error" in result.stdout and Calibration.load(tmp_path / "r.json").source == "run"
    assert runner.invoke(app, ["plan", "calibrate", "--run", str(tmp_path)]).exit_code == 2  # no steps.jsonl
    assert runner.invoke(app, ["plan", "calibrate"]).exit_code == 2
    assert "calibrate" in runner.invoke(app, ["plan"]).stdout
