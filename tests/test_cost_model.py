"""The learned step and KV transfer cost models: synthetic records of known coefficients,
the guards (non-negative, sliding window, cold start), and records of the real engine."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time

import numpy as np
import pytest

from tests.engine_support import greedy, make_engine_fixture, random_prompts  # noqa: F401
from workers.engine.cost_model import (
    DEFAULT_COEFFICIENTS,
    StepCoefficients,
    StepCostFit,
    StepFeatures,
    predict_step_s,
    step_features,
)
from workers.engine.nnls_fit import nnls
from workers.engine.step_cost import StepRecord
from workers.engine.transfer_cost import (
    DEFAULT_TRANSFER,
    TransferCoefficients,
    TransferCostFit,
    TransferCosts,
)

TRUE = StepCoefficients(fixed_s=0.005, prefill_token_s=5e-5, prefill_attention_s=2e-8,
                        decode_seq_s=3e-4, decode_context_s=2e-6)


def step(t: float, prefill_tokens: int, decode_seqs: int, decode_context: int, prior: int = 0) -> StepRecord:
    """A step with at most one prefill chunk of `prefill_tokens` after `prior` tokens."""
    end = prior + prefill_tokens if prefill_tokens else 0
    return StepRecord(start_time=0.0, step_time_s=t, num_prefill_tokens=prefill_tokens,
                      num_decode_seqs=decode_seqs, num_context_tokens=decode_context + end,
                      num_running=decode_seqs + 1, num_waiting=0, num_prefill_seqs=int(prefill_tokens > 0),
                      prefill_attention_work=prefill_tokens * end)


def synthetic_steps(n: int, true: StepCoefficients = TRUE, noise: float = 0.03,
                    seed: int = 0) -> list[StepRecord]:
    """Pure decode, pure prefill and mixed steps; time = the true model x U(1 +- noise)."""
    rng = random.Random(seed)
    steps = []
    for _ in range(n):
        kind = rng.choice(["decode", "prefill", "mixed"])
        chunk = rng.randint(16, 512) if kind != "decode" else 0
        prior = rng.randint(0, 1024) if chunk else 0
        work = chunk * (prior + chunk) if chunk else 0
        seqs = rng.randint(1, 32) if kind != "prefill" else 0
        decode_ctx = sum(rng.randint(16, 2048) for _ in range(seqs))
        features = StepFeatures(chunk, work, seqs, decode_ctx)
        t = float(features.row() @ true.vector()) * rng.uniform(1 - noise, 1 + noise)
        steps.append(step(t, chunk, seqs, decode_ctx, prior))
    return steps


def fitted(steps) -> StepCostFit:
    model = StepCostFit()
    model.seed(steps)
    return model


def test_known_coefficients_are_recovered_and_held_out_steps_predicted():
    model = fitted(synthetic_steps(512, seed=1))
    got, want = model.coefficients.vector(), TRUE.vector()
    assert got == pytest.approx(want, rel=0.05)
    assert model.median_relative_error(synthetic_steps(500, seed=2)) <= 0.05


def test_coefficients_are_json_ready():
    c = fitted(synthetic_steps(64)).coefficients
    assert StepCoefficients.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("zeroed", ["fixed_s", "prefill_attention_s", "decode_context_s"])
def test_a_true_zero_stays_non_negative(zeroed):
    true = StepCoefficients(**{**TRUE.to_dict(), zeroed: 0.0})
    c = fitted(synthetic_steps(512, true, seed=3)).coefficients
    assert (c.vector() >= 0).all()
    assert getattr(c, zeroed) <= 0.02 * max(true.vector())  # near zero, not a compensating swing
    assert fitted(synthetic_steps(512, true, seed=3)).median_relative_error(
        synthetic_steps(200, true, seed=4)) <= 0.05


def test_data_that_pulls_a_coefficient_negative_is_clamped():
    """Bigger decode batches that are cheaper per step would need c3 < 0."""
    steps = [step(0.02 - 0.0004 * s, 0, s, 100 * s) for s in range(1, 33)]
    c = fitted(steps).coefficients
    assert (c.vector() >= 0).all() and c.decode_seq_s == 0.0
    unconstrained = np.linalg.lstsq(np.stack([step_features(s).row() for s in steps])[:, [0, 3, 4]],
                                    [s.step_time_s for s in steps], rcond=None)[0]
    assert min(unconstrained) < 0  # what an unconstrained fit would have done


def test_the_window_follows_a_change_in_the_true_costs():
    model = StepCostFit(window=256, refit_every=32)
    for record in synthetic_steps(256, seed=5):
        model.observe(record)
    slower = StepCoefficients(*(2 * TRUE.vector()))
    for record in synthetic_steps(256, slower, seed=6):
        model.observe(record)
    model.fit()  # the last automatic refit may be up to 31 records old
    assert model.coefficients.vector() == pytest.approx(slower.vector(), rel=0.05)
    assert model.median_relative_error(synthetic_steps(200, slower, seed=7)) <= 0.05


def test_three_warm_up_steps_predict_finite_positive_times():
    model = StepCostFit()
    assert model.coefficients == DEFAULT_COEFFICIENTS
    assert model.predict(StepFeatures(prefill_tokens=100)) > 0  # cold: the stated default
    model.seed(synthetic_steps(3, seed=8))
    assert (model.coefficients.vector() >= 0).all()
    for features in [StepFeatures(), StepFeatures(512, 512 * 512), StepFeatures(0, 0, 8, 4000),
                     StepFeatures(1, 1, 1, 1)]:
        t = model.predict(features)
        assert math.isfinite(t) and t > 0


def test_a_young_window_refits_without_waiting_for_a_full_batch():
    model = StepCostFit(refit_every=32)
    for record in synthetic_steps(24, seed=10):
        model.observe(record)
    assert model.coefficients.num_samples >= 12  # refit at least once past the first half


def test_idle_steps_are_not_learned():
    model = StepCostFit()
    model.observe(step(0.5, 0, 0, 0))
    assert model.num_samples == 0


def test_nnls_matches_the_best_non_negative_subset():
    rng = np.random.default_rng(0)
    for _ in range(50):
        a, b = rng.normal(size=(40, 5)), rng.normal(size=40)
        x = nnls(a, b)
        assert (x >= 0).all()
        best = min(_subset_loss(a, b, mask) for mask in range(32))
        assert np.sum((a @ x - b) ** 2) == pytest.approx(best, rel=1e-6, abs=1e-9)


def _subset_loss(a, b, mask):
    idx = [j for j in range(5) if mask >> j & 1]
    if not idx:
        return float(np.sum(b ** 2))
    x = np.linalg.lstsq(a[:, idx], b, rcond=None)[0]
    return float(np.sum((a[:, idx] @ x - b) ** 2)) if (x >= 0).all() else math.inf


@pytest.mark.parametrize(("kappa", "limit_ms"), [(None, 50), (0.3, 200)])
def test_refit_of_a_full_window_is_fast(kappa, limit_ms):
    """`kappa`: records with busy neighbours, so the fit also searches the contention factor."""
    steps = synthetic_steps(512, seed=9)
    model = StepCostFit()
    for record in steps if kappa is None else contended(steps, kappa):
        model.observe(record)
    start = time.perf_counter()
    for _ in range(5):
        model.fit()
    per_fit_ms = (time.perf_counter() - start) / 5 * 1e3
    print(f"refit of 512 records (contention {kappa}): {per_fit_ms:.3f} ms")
    assert per_fit_ms < limit_ms


def transfer_samples(fixed_s, bytes_per_s, n=200, seed=0, noise=0.03):
    rng = random.Random(seed)
    sizes = [rng.randint(1 << 12, 1 << 26) for _ in range(n)]
    return [(b, (fixed_s + b / bytes_per_s) * rng.uniform(1 - noise, 1 + noise)) for b in sizes]


def test_transfer_fit_recovers_fixed_cost_and_bandwidth():
    fit = TransferCostFit()
    for b, s in transfer_samples(0.003, 5e9):
        fit.observe(b, s)
    c = fit.coefficients
    assert c.fixed_s == pytest.approx(0.003, rel=0.05) and c.bytes_per_s == pytest.approx(5e9, rel=0.05)
    assert fit.predict(1 << 20) == pytest.approx(0.003 + (1 << 20) / 5e9, rel=0.05)
    assert TransferCoefficients.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_transfer_fit_stays_non_negative_and_cold_pairs_predict():
    fit = TransferCostFit()
    assert fit.coefficients == DEFAULT_TRANSFER
    for b, s in transfer_samples(0.0, 1e9, seed=1):  # no fixed cost at all
        fit.observe(b, s)
    assert 0 <= fit.coefficients.fixed_s < 1e-4
    one = TransferCostFit()
    one.observe(1 << 20, 0.01)  # one sample: finite, positive
    assert 0 < one.predict(1 << 20) < 0.1 and one.coefficients.bytes_per_s > 0


def test_transfer_costs_per_pair_and_pooled_for_unseen_pairs():
    costs = TransferCosts()
    for b, s in transfer_samples(0.002, 1e10, n=100, seed=2):
        costs.observe("p0", "d0", b, s)
    for b, s in transfer_samples(0.010, 1e9, n=100, seed=3):
        costs.observe("p1", "d0", b, s)
    assert costs.fit_for("p0", "d0").coefficients.bytes_per_s == pytest.approx(1e10, rel=0.05)
    assert costs.fit_for("p1", "d0").coefficients.fixed_s == pytest.approx(0.010, rel=0.05)
    pooled = costs.predict("p9", "d9", 1 << 24)
    assert costs.predict("p0", "d0", 1 << 24) < pooled < costs.predict("p1", "d0", 1 << 24)
    assert set(costs.coefficients()) == {"p0->d0", "p1->d0", "*"}


def test_the_real_engines_records_are_predicted(make_engine):
    """Fit on half the tiny model's step records, predict the other half (CPU timing is
    noisy, so only a loose bound is asserted; the figure is printed)."""
    engine = make_engine(max_num_batched_tokens=128)
    lens = [5, 40, 300, 17, 120, 64, 9, 200, 33, 90] * 3
    engine.generate(random_prompts(lens, seed=4), greedy(24, ignore_eos=True))
    records = list(engine.step_records)
    worked = [r for r in records if r.num_prefill_tokens or r.num_decode_seqs]
    assert all(0 < r.cpu_time_s <= r.step_time_s + 1e-3 and r.run_wait_s >= 0 for r in worked)
    model = fitted(records[0::2])
    error = model.median_relative_error(records[1::2])
    print(f"real records: {len(records)}, held-out median relative error {error:.3f}, "
          f"coefficients {model.coefficients.to_dict()}")
    assert math.isfinite(error) and error < 0.5


def contended(steps: list[StepRecord], kappa: float, seed: int = 0) -> list[StepRecord]:
    """`steps` with a node busy of 0, 0.5 or 1 other engine and their time slowed by
    1 + kappa x that."""
    rng = random.Random(seed)
    out = []
    for s in steps:
        busy = rng.choice([0.0, 0.5, 1.0])
        out.append(dataclasses.replace(s, step_time_s=s.step_time_s * (1 + kappa * busy), node_busy=busy))
    return out


def test_the_node_contention_factor_is_recovered_with_the_coefficients():
    model = fitted(contended(synthetic_steps(512, seed=3), kappa=0.6))
    c = model.coefficients
    assert c.node_contention == pytest.approx(0.6)
    assert c.vector() == pytest.approx(TRUE.vector(), rel=0.08)
    held_out = contended(synthetic_steps(300, seed=4), kappa=0.6, seed=5)
    assert model.median_relative_error(held_out) <= 0.05
    alone = StepCostFit()
    alone.seed(synthetic_steps(512, seed=3))  # no busy neighbour in any record: no factor
    assert alone.coefficients.node_contention == 0.0


def test_a_slowed_model_prices_a_busy_node():
    c = dataclasses.replace(TRUE, node_contention=0.5)
    features = StepFeatures(0, 0, 8, 4096)
    alone = predict_step_s(c, features)
    assert predict_step_s(c, dataclasses.replace(features, node_busy=2.0)) == pytest.approx(2.0 * alone)
    assert c.slowed(2.0).vector() == pytest.approx(2.0 * c.vector())
    assert c.slowed(0.0) is c
    assert StepCoefficients.from_dict(c.to_dict()) == c


def waiting(steps: list[StepRecord], mean_wait: float, kappa: float = 0.0, seed: int = 0) -> list[StepRecord]:
    """`steps` as a crowded node runs them: each step's time is its CPU time (the true
    work, +-3%), slowed by 1 + kappa x its busy neighbours, plus a run-queue wait of
    U(0, 2 x mean_wait) times that (a wide scatter, as waiting for a core has)."""
    rng = random.Random(seed)
    out = []
    for s in steps:
        busy = rng.choice([0.0, 0.5, 1.0]) if kappa else 0.0
        cpu = s.step_time_s
        slowed = cpu * (1 + kappa * busy)
        wait = slowed * rng.uniform(0.0, 2 * mean_wait)
        out.append(dataclasses.replace(s, step_time_s=slowed + wait, cpu_time_s=cpu, run_wait_s=wait,
                                       node_busy=busy))
    return out


@pytest.mark.parametrize("kappa", [0.0, 0.6])
def test_the_work_is_fitted_on_cpu_time_and_the_mean_wait_on_wall_time(kappa):
    """A wide run-queue wait scatters the wall times; the shape comes from the CPU time,
    so every coefficient is the true one times the mean stretch (1 + mean wait), and the
    mean step time is predicted, not its lower part."""
    steps = waiting(synthetic_steps(512, seed=11), mean_wait=0.4, kappa=kappa, seed=12)
    c = fitted(steps).coefficients
    assert c.node_contention == pytest.approx(kappa, abs=0.15)
    assert c.vector() == pytest.approx(1.4 * TRUE.vector(), rel=0.1)
    held_out = waiting(synthetic_steps(400, seed=13), mean_wait=0.4, kappa=kappa, seed=14)
    predicted = np.array([predict_step_s(c, step_features(r)) for r in held_out])
    ratios = np.array([r.step_time_s for r in held_out]) / predicted
    assert np.mean(ratios) == pytest.approx(1.0, abs=0.05)


def test_records_without_cpu_time_are_fitted_on_wall_time_alone():
    """Old records (no CPU time) and threads that mostly sleep keep the one-stage fit."""
    steps = synthetic_steps(512, seed=1)
    assert fitted(steps).coefficients.vector() == pytest.approx(TRUE.vector(), rel=0.05)
    sleeper = [dataclasses.replace(s, cpu_time_s=0.001) for s in steps]  # a thread that waits on another
    assert fitted(sleeper).coefficients.vector() == pytest.approx(TRUE.vector(), rel=0.05)


def _one_chunk_size(n: int, chunk: int = 74, prompt_len: int = 2016, seed: int = 21) -> list[StepRecord]:
    """A long prompt prefilled in the background beside three streams, over and over:
    every step the same chunk size, the fixed cost and the cost per token collinear."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        for prior in range(0, prompt_len - chunk, chunk):
            features = StepFeatures(chunk, chunk * (prior + chunk), 3, 1800)
            t = float(features.row() @ TRUE.vector()) * rng.uniform(0.9, 1.1)
            out.append(dataclasses.replace(step(t, chunk, 3, 1800, prior), cpu_time_s=t))
    return out[:n]


def _fresh_prompt_s(model: StepCostFit, prompt_len: int = 2016, chunk: int = 512) -> float:
    return sum(model.predict(StepFeatures(min(chunk, prompt_len - s), min(chunk, prompt_len - s) * min(prompt_len, s + chunk),
                                          0, 0)) for s in range(0, prompt_len, chunk))


def _true_prompt_s(prompt_len: int = 2016, chunk: int = 512) -> float:
    """What `_fresh_prompt_s` should come to: the same chunks priced by TRUE."""
    return sum(float(StepFeatures(min(chunk, prompt_len - s), min(chunk, prompt_len - s) * min(prompt_len, s + chunk),
                                  0, 0).row() @ TRUE.vector()) for s in range(0, prompt_len, chunk))


def test_the_warm_ups_records_pin_the_shape_a_one_chunk_window_cannot_tell():
    truth = _true_prompt_s()
    warm = [dataclasses.replace(r, cpu_time_s=r.step_time_s) for r in synthetic_steps(120, seed=20)]
    live = _one_chunk_size(512)
    unanchored = fitted(warm + live)  # the warm-up's records pushed out of the window
    anchored = StepCostFit()
    anchored.seed(warm)
    anchored.anchor()
    assert anchored.num_anchors == 120
    for record in live:
        anchored.observe(record)
    anchored.fit()
    assert abs(_fresh_prompt_s(unanchored) / truth - 1) > 0.25  # the window alone misprices it
    assert _fresh_prompt_s(anchored) == pytest.approx(truth, rel=0.1)
    # and the live steps themselves are still predicted as well as the window alone does
    for model in (anchored, unanchored):
        assert model.median_relative_error(live[-50:]) < 0.1


def test_scaling_a_model_scales_c0_to_c4_and_keeps_every_other_field():
    import dataclasses

    model = StepCoefficients(0.01, 2e-4, 3e-9, 4e-4, 5e-7, num_samples=7, node_contention=0.3,
                             node_stream_contention=0.002)
    scaled = model.scaled(1.5)
    assert scaled.vector() == pytest.approx(1.5 * model.vector())
    others = [f.name for f in dataclasses.fields(StepCoefficients)
              if f.name not in ("fixed_s", "prefill_token_s", "prefill_attention_s", "decode_seq_s", "decode_context_s")]
    assert others and all(getattr(scaled, name) == getattr(model, name) for name in others)


def test_a_warm_up_that_waited_for_cores_still_pins_the_prefill_cost_of_a_decode_only_window():
    """The warm-up ran beside other replicas starting on the same cores: its thread was
    on a CPU for 40% of its wall time. The live window holds decode steps alone (every
    prompt went elsewhere), so only the anchors see a prompt token; they price it."""
    truth = _true_prompt_s()
    crowded = [dataclasses.replace(r, step_time_s=r.step_time_s / 0.4, cpu_time_s=r.step_time_s)
               for r in synthetic_steps(120, seed=30)]
    rng = random.Random(31)
    decode_only = []
    for _ in range(512):
        seqs, context = rng.randint(1, 3), rng.randint(100, 400)
        t = float(StepFeatures(0, 0, seqs, seqs * context).row() @ TRUE.vector()) * rng.uniform(0.9, 1.1)
        decode_only.append(dataclasses.replace(step(t, 0, seqs, seqs * context), cpu_time_s=t))
    model = StepCostFit()
    model.seed(crowded)
    model.anchor()
    for record in decode_only:
        model.observe(record)
    model.fit()
    assert model.coefficients.prefill_token_s > 0.5 * TRUE.prefill_token_s
    assert _fresh_prompt_s(model) == pytest.approx(truth, rel=0.25)
