"""Fit the step and transfer models on records and score the step model on records it
was not fitted on.

The step model is the `auto` policy's (`cost_model`: fixed + per prompt token + per unit
of prefill attention + per decode sequence + per context token, all >= 0, times the
slowdown of the node's other engines busy meanwhile and of its streams lately), fitted here
on absolute step time rather than the policy's relative error: a simulator's queues and
throughput follow the MEAN step time, and on a contended machine (a replica sharing its
cores with others) step times scatter by several times with a long upper tail, which a
relative-error fit answers with a prediction near the lower quartile. The transfer model
is the policy's own fit (`transfer_cost.fit_transfer`).

The held-out split is every `HOLD_OUT_EVERY`-th step with work, per replica in time
order: the held-out records span the whole run (every batch size, every phase of the
load) the way the fitted ones do, and none of them is ever fitted on.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cluster.plan.calibration import FitQuality, StepModel, TransferModel
from cluster.plan.records import ReplicaStep, ReplicaTransfer
from workers.engine.cost_model import StepCoefficients, has_work, predict_steps_s, step_features
from workers.engine.nnls_fit import (
    MIN_STEP_S,
    fit_with_contention,
    fit_work_then_wall,
    fits_on_cpu_time,
    nnls,
)
from workers.engine.transfer_cost import DEFAULT_TRANSFER, fit_transfer

HOLD_OUT_EVERY = 5  # every 5th record (per replica, time order) is scored, never fitted


def split_held_out(steps: Sequence[ReplicaStep], every: int = HOLD_OUT_EVERY) -> tuple[list[ReplicaStep], list[ReplicaStep]]:
    """(fitted, held out): the steps with work of each replica in time order, every
    `every`-th one held out."""
    fitted, held_out = [], []
    by_replica: dict[str, list[ReplicaStep]] = {}
    for s in steps:
        if has_work(s.record):
            by_replica.setdefault(s.replica_id, []).append(s)
    for kept in by_replica.values():
        for i, step in enumerate(sorted(kept, key=lambda s: s.record.start_time)):
            (held_out if i % every == every - 1 else fitted).append(step)
    return fitted, held_out


def fit_steps(steps: Sequence[ReplicaStep]) -> StepCoefficients:
    """The step model over all of `steps` (those with work): the work's shape, then how
    the node stretches it (`fit_work_then_load`)."""
    kept = [s for s in steps if has_work(s.record)]
    if not kept:
        raise ValueError("no step records with work to fit on")
    a, t, busy, rate = _design(kept)
    c, kappa, gamma = fit_work_then_load(a, t, _cpu_times(kept), busy, rate)
    return StepCoefficients.from_vector(c, len(kept), kappa, gamma)


def fit_work_then_load(a: np.ndarray, wall: np.ndarray, cpu: np.ndarray, busy: np.ndarray,
                       rate: np.ndarray) -> tuple[np.ndarray, float, float]:
    """(c, k, g) minimising the squared error of the wall time. Where the records carry
    the work (`fits_on_cpu_time`): its shape w = a @ c_work on CPU time, then
    wall = w x (s + s k busy + s g rate) with s, sk, sg >= 0, so the stretch the node puts
    on the work follows how busy its engines and its streams were; c = s x c_work.
    Otherwise the shape and k on wall time, g = 0."""
    if not fits_on_cpu_time(wall, cpu):
        c, kappa = fit_with_contention(a, wall, busy, fit=nnls_mean, loss=squared_loss)
        return c, kappa, 0.0
    c_work, _ = fit_with_contention(a, cpu, busy, fit=nnls_mean, loss=squared_loss)
    work = np.maximum(MIN_STEP_S, a @ c_work)
    s, sk, sg = nnls_mean(np.stack([work, work * busy, work * rate], axis=1), wall)
    if s <= 0:  # the stretch is all load: keep the work's own scale, the load terms on top
        return fit_work_then_wall(a, wall, cpu, busy, fit=nnls_mean, loss=squared_loss,
                                  scale=least_squares_scale) + (0.0,)
    return c_work * s, sk / s, sg / s


def fit_reported(steps: Sequence[ReplicaStep]) -> StepCoefficients:
    """The step model as a replica fits it online and reports it to the router (relative
    error, `nnls_fit.fit_step_coefficients`; no stream term, which a replica cannot
    see) over `steps` (those with work)."""
    kept = [s for s in steps if has_work(s.record)]
    a, t, busy, _ = _design(kept)
    c, kappa = fit_work_then_wall(a, t, _cpu_times(kept), busy)
    return StepCoefficients.from_vector(c, len(kept), kappa)


def _design(steps: Sequence[ReplicaStep]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(feature rows, step times, node busy, node decode rate) of `steps`."""
    return (np.stack([step_features(s.record).row() for s in steps]),
            np.array([s.record.step_time_s for s in steps]), np.array([s.record.node_busy for s in steps]),
            np.array([s.node_decode_rate for s in steps]))


def _cpu_times(steps: Sequence[ReplicaStep]) -> np.ndarray:
    return np.array([s.record.cpu_time_s for s in steps])


def squared_loss(predicted: np.ndarray, measured: np.ndarray) -> float:
    return float(np.sum((predicted - measured) ** 2))


def least_squares_scale(predicted: np.ndarray, measured: np.ndarray) -> float:
    """The s minimising sum((s * predicted - measured)^2)."""
    return float(predicted @ measured / (predicted @ predicted))


def nnls_mean(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """c >= 0 minimising sum((a @ c - t)^2), columns scaled to unit norm (seconds per
    step and per token solved on one footing); all-zero columns keep c = 0."""
    norms = np.linalg.norm(a, axis=0)
    used = norms > 0
    c = np.zeros(a.shape[1])
    c[used] = nnls(a[:, used] / norms[used], t) / norms[used]
    return c


def relative_errors(c: StepCoefficients, steps: Sequence[ReplicaStep]) -> np.ndarray:
    """|predicted - measured| / measured per step with work."""
    kept = [s for s in steps if has_work(s.record)]
    if not kept:
        return np.zeros(0)
    a, measured, busy, rate = _design(kept)
    return np.abs(predict_steps_s(c, a, busy, rate) - measured) / measured


def fit_and_score(steps: Sequence[ReplicaStep], every: int = HOLD_OUT_EVERY) -> tuple[StepModel, FitQuality]:
    """Fit on all but the held-out steps; the quality is measured on the held-out ones.
    (`fit_reported` on the same fitted steps gives what the replicas report.)"""
    fitted, held_out = split_held_out(steps, every)
    if len(fitted) < 2 or not held_out:
        raise ValueError(f"too few step records with work to fit and score ({len(fitted) + len(held_out)}); "
                         f"calibrate from a longer run or sweep")
    c = fit_steps(fitted)
    errors = relative_errors(c, held_out)
    work_error, wait_share = score_work(fitted, held_out)
    spread, share = same_shape_spread(fitted + held_out)
    quality = FitQuality(median_relative_error=float(np.median(errors)),
                         p90_relative_error=float(np.percentile(errors, 90)),
                         num_fitted=len(fitted), num_held_out=len(held_out),
                         work_median_relative_error=work_error, run_wait_share=wait_share,
                         same_shape_spread=spread, same_shape_share=share)
    return StepModel.of(c), quality


def score_work(fitted: Sequence[ReplicaStep], held_out: Sequence[ReplicaStep]) -> tuple[float | None, float | None]:
    """(median relative error of the work model on the held-out steps' CPU time, their
    mean run-queue wait over their mean CPU time); (None, None) unless both sets are
    fitted on CPU time (`fits_on_cpu_time`). The work model is the two-stage fit's first
    stage, fitted as the policy fits it."""
    a, wall, busy, _ = _design(fitted)
    held_a, held_wall, held_busy, _ = _design(held_out)
    cpu, held_cpu = _cpu_times(fitted), _cpu_times(held_out)
    if not (fits_on_cpu_time(wall, cpu) and fits_on_cpu_time(held_wall, held_cpu)):
        return None, None
    c, kappa = fit_with_contention(a, cpu, busy)
    predicted = np.maximum(MIN_STEP_S, (held_a @ c) * (1.0 + kappa * held_busy))
    wait = np.array([s.record.run_wait_s for s in held_out])
    return float(np.median(np.abs(predicted - held_cpu) / held_cpu)), float(wait.mean() / held_cpu.mean())


SAME_SHAPE_MIN = 5  # steps alike before their scatter counts
CONTEXT_BIN = 1.05  # decode context tokens alike within 5%
RATE_BIN = 1.10  # the node's decode rate alike within 10%


def same_shape_spread(steps: Sequence[ReplicaStep]) -> tuple[float | None, float | None]:
    """(the median over steps of |t - c| / t, c the time that makes that error least over
    the steps of the same shape; the share of `steps` in a group of at least
    `SAME_SHAPE_MIN`), or (None, None) with no such group. Alike: the same role, prompt
    tokens and decode sequences, busy neighbours within 0.1, decode context within 5%
    and the node's decode rate within 10%. That is what the step model reads, so any
    such model prices steps alike the same, and on these records it errs at least about
    this much: the scatter of the node's wait for a core, on a shared machine."""
    groups: dict[tuple, list[float]] = {}
    for s in steps:
        if not has_work(s.record):
            continue
        f = step_features(s.record)
        key = (s.role, f.prefill_tokens, f.decode_seqs, round(f.node_busy, 1), _bin(f.decode_context_tokens, CONTEXT_BIN),
               _bin(s.node_decode_rate, RATE_BIN))
        groups.setdefault(key, []).append(s.record.step_time_s)
    errors = [e for times in groups.values() if len(times) >= SAME_SHAPE_MIN for e in _best_constant_errors(times)]
    if not errors:
        return None, None
    return float(np.median(errors)), len(errors) / sum(len(t) for t in groups.values())


def _best_constant_errors(times: list[float], num_candidates: int = 64) -> np.ndarray:
    """|t - c| / t of each time, at the c that makes their median least (searched over
    `num_candidates` points between the least and the greatest time, geometrically)."""
    t = np.asarray(times)
    candidates = np.geomspace(t.min(), t.max(), num_candidates) if t.max() > t.min() else t[:1]
    errors = np.abs(t[None, :] - candidates[:, None]) / t[None, :]
    return errors[int(np.argmin(np.median(errors, axis=1)))]


def _bin(x: float, width: float) -> int:
    return 0 if x <= 0 else 1 + round(np.log(x) / np.log(width))


def fit_transfers(transfers: Sequence[ReplicaTransfer]) -> tuple[TransferModel, str]:
    """(model, note): the transfer cost over every sender's records against payload bytes,
    in what a transfer adds to time to first token: the tail from the last layer handed
    to the acknowledgement (`tail_seconds`, what the policy's `TransferTails` fits; the
    layers before it stream while the prompt is still computing). The path most records
    took. No records: the policy's cold default, and a note saying so."""
    transfers = [t for t in transfers if t.record.tail_seconds > 0]  # relative error needs a positive time
    if not transfers:
        return (TransferModel.of(DEFAULT_TRANSFER, path="none"),
                "no KV transfer records: the transfer model is the policy's cold default, not measured")
    num_bytes = np.array([t.record.num_bytes for t in transfers], dtype=float)
    seconds = np.array([t.record.tail_seconds for t in transfers], dtype=float)
    c = fit_transfer(num_bytes, seconds, DEFAULT_TRANSFER)
    paths = [t.record.data_path for t in transfers]
    return TransferModel.of(c, path=max(set(paths), key=paths.count)), ""
