"""The start-up warm-up: it seeds the step-cost fit from synthetic requests and leaves
the engine otherwise as it found it (tiny model, fp32, CPU)."""

from __future__ import annotations

import copy
import time
from types import SimpleNamespace

import pytest

from cluster.config import load_config
from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine.cost_model import DEFAULT_COEFFICIENTS, MAX_ANCHORS, StepCostFit
from workers.engine.nnls_fit import MIN_FULL_FIT
from workers.engine.warmup import long_prompt_lens, warmup
from workers.engine_worker import EngineWorker

PROMPTS = random_prompts([5, 40, 300, 17, 120], seed=3)


def _without_model(stats: dict) -> dict:
    """The stats less what is measured in time (the step model, the recent stream gap, the
    steps' seconds)."""
    return {k: v for k, v in stats.items()
            if k != "step_model" and not k.startswith("recent_") and not k.endswith("_seconds_total")}


def test_the_warm_up_puts_the_steps_seconds_back(make_engine):
    engine = make_engine()
    engine.generate(PROMPTS[:1], greedy(3))
    before = {k: v for k, v in engine.stats().items() if k.endswith("_seconds_total")}
    assert before["step_wall_seconds_total"] > 0 and before["step_cpu_seconds_total"] > 0
    engine.warmup()
    assert {k: v for k, v in engine.stats().items() if k.endswith("_seconds_total")} == before


def test_the_warm_up_seeds_the_fit_and_leaves_nothing_behind(make_engine):
    engine, fresh = make_engine(max_num_batched_tokens=256), make_engine(max_num_batched_tokens=256)
    before = engine.stats()
    t0 = time.perf_counter()
    coefficients = engine.warmup()
    print(f"tiny warm-up: {time.perf_counter() - t0:.3f} s, {coefficients}")
    assert coefficients == engine.cost_fit.coefficients != DEFAULT_COEFFICIENTS
    assert coefficients.num_samples >= MIN_FULL_FIT  # a full fit, not c0 + one term
    assert engine.cost_fit.num_anchors == min(coefficients.num_samples, MAX_ANCHORS)  # kept for later fits
    assert engine.stats()["step_model"] == coefficients.to_dict()
    assert _without_model(engine.stats()) == _without_model(before)  # counters, queue, blocks
    assert not engine.requests and not engine.step_records and not engine.block_manager.cached_blocks
    assert engine.block_manager.enable_prefix_caching
    engine.check_integrity()
    # it serves exactly as an engine that never warmed up
    params = greedy(12, ignore_eos=True)
    assert ([o.token_ids for o in engine.generate(PROMPTS, params)]
            == [o.token_ids for o in fresh.generate(PROMPTS, params)])
    assert _without_model(engine.stats()) == _without_model(fresh.stats())


def test_the_warm_up_keeps_what_the_prefix_cache_and_counters_held(make_engine):
    engine = make_engine()
    engine.generate(PROMPTS[2:3], greedy(2))
    before, cached = engine.stats(), dict(engine.block_manager.cached_blocks)
    assert before["prefix_cache_queries"] and cached
    warmup(engine)
    assert _without_model(engine.stats()) == _without_model(before)
    assert engine.block_manager.cached_blocks == cached  # none evicted: the pool had room
    engine.generate(PROMPTS[2:3], greedy(2))
    assert engine.stats()["prefix_cache_hits"] == before["prefix_cache_hits"] + 288  # 18 blocks of 16


def test_the_seeded_fit_predicts_the_first_real_steps(make_engine):
    """Loose: CPU timing on a shared machine is noisy; the figures are printed."""
    engine = make_engine(max_num_batched_tokens=128)
    engine.warmup()
    seeded = copy.deepcopy(engine.cost_fit)  # the seed alone, not what the real steps teach
    engine.generate(random_prompts([5, 40, 300, 17, 120, 64, 9, 200, 33, 90] * 2, seed=4),
                    greedy(16, ignore_eos=True))
    error = seeded.median_relative_error(engine.step_records)
    cold = StepCostFit().median_relative_error(engine.step_records)
    print(f"seeded median relative error {error:.3f} (cold defaults: {cold:.3f})")
    assert error < 1.0


def test_a_small_pool_and_budget_still_warm_up(make_engine):
    engine = make_engine(num_kv_blocks=24, max_num_batched_tokens=64, max_num_seqs=4)
    assert max(long_prompt_lens(engine)) <= 24 * 16 // 3
    coefficients = warmup(engine, budget_s=0.0)  # the first wave only
    assert coefficients.num_samples > 0
    assert _without_model(engine.stats())["kv_blocks_free"] == 24
    assert not engine.requests


def test_a_busy_engine_is_not_warmed_up(make_engine):
    engine = make_engine()
    engine.add_request("r", PROMPTS[0], greedy(2))
    with pytest.raises(RuntimeError, match="idle"):
        engine.warmup()
    engine.abort_request("r")
    engine.step()


@pytest.mark.parametrize("warm", [True, False])
def test_the_worker_warms_its_engine_up_unless_configured_off(tiny_model_dir, warm):
    config = load_config({"model": {"path": str(tiny_model_dir), "device": "cpu"},
                          "engine": {"num_kv_blocks": 128, "warmup": warm}})
    worker = SimpleNamespace(config=config, role="decode", replica_id="test", node_id=f"test-node-{time.time_ns()}",
                             _pool_config=lambda: config.decode)
    worker._node_activity = lambda: EngineWorker._node_activity(worker)
    engine = EngineWorker._build_engine(worker)  # the real method, outside Ray
    try:
        assert (engine.cost_fit.coefficients != DEFAULT_COEFFICIENTS) is warm
        assert engine.stats()["kv_blocks_free"] == 128 and not engine.step_records
        assert engine.node_activity is not None  # its slot on the node's board
        engine.check_integrity()
    finally:
        engine.node_activity.close()


def test_a_failed_warm_up_leaves_no_request_behind(make_engine, monkeypatch):
    """The failure is injected (a step that raises once some requests are queued)."""
    engine = make_engine()
    real_step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 5:
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(engine, "step", failing_step)
    with pytest.raises(RuntimeError, match="injected"):
        engine.warmup()
    assert not engine.requests and not engine.has_unfinished_requests()
    assert engine.stats()["kv_blocks_free"] == 512 and engine.block_manager.enable_prefix_caching
