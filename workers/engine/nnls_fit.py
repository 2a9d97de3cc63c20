"""The step model's fitting arithmetic (cost_model.py): c >= 0 minimising the relative
error sum(((a @ c - t) / t)^2) by active-set NNLS, c0 plus the best single term where the
window is too small or rank-deficient for the rest, the contention factor k chosen from
`CONTENTION_GRID` by the same loss, and the two-stage fit: the work's shape on the
thread's CPU time, then one scale and k on wall time.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

CONTENTION_GRID = (0.0, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.3, 1.7, 2.2, 3.0)
MIN_CPU_SHARE = 0.5  # median CPU time / wall time of a window fitted in two stages
MIN_FULL_FIT = 16  # fewer records (or a rank-deficient window): c0 + one term
MIN_STEP_S = 1e-6  # predictions never go below this


def fit_with_contention(a: np.ndarray, t: np.ndarray, busy: np.ndarray,
                        fit: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                        loss: Callable[[np.ndarray, np.ndarray], float] | None = None) -> tuple[np.ndarray, float]:
    """(c, k): for each k of `CONTENTION_GRID`, c fitted by `fit` (default: relative
    error) on the rows scaled by 1 + k * busy; the pair with the least `loss` of
    (predicted, measured) (default: relative). k = 0 when no record saw another busy engine."""
    fit = fit or fit_step_coefficients
    loss = loss or relative_loss
    if not (busy > 0).any():
        return fit(a, t), 0.0
    best: tuple[float, np.ndarray, float] | None = None
    for kappa in CONTENTION_GRID:
        factor = 1.0 + kappa * busy
        c = fit(a * factor[:, None], t)
        value = loss(np.maximum(MIN_STEP_S, (a @ c) * factor), t)
        if best is None or value < best[0] - 1e-12:
            best = (value, c, kappa)
    return best[1], best[2]


def fit_work_then_wall(a: np.ndarray, wall: np.ndarray, cpu: np.ndarray, busy: np.ndarray,
                       fit: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None,
                       loss: Callable[[np.ndarray, np.ndarray], float] | None = None,
                       scale: Callable[[np.ndarray, np.ndarray], float] | None = None,
                       anchors: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
                       ) -> tuple[np.ndarray, float]:
    """(c, k) of the wall-time model. Where `fits_on_cpu_time(wall, cpu)`: the work's
    shape w = a @ c_work fitted on CPU time (`fit_with_contention`, its k dropped), then
    for each k of the grid the scale s = `scale(w * (1 + k busy), wall)` (default: the
    mean ratio), the pair with the least `loss`; c = s * c_work. Otherwise
    `fit_with_contention` on wall time. `anchors` (rows, wall, busy, cpu: records kept
    for good, `StepCostFit.anchor`) join the shape's fit, or the wall-time fit.

    In the shape's fit the anchors count by their CPU time however little of their wall
    time it was: where the window's CPU time is the work, the same engine's is too, and a
    warm-up that waited for cores (replicas starting together on two) only stretched its
    wall time. Held to the window's share test instead, such anchors were left out; a
    decode replica whose window then held decode steps alone priced a prompt token at 0,
    and a 1,816-token prompt at two steps' fixed cost (27.7 ms, against 1.6-3.5 s). Their
    wall time stands in where they carry no CPU time."""
    if not fits_on_cpu_time(wall, cpu):
        if anchors is not None:
            a, wall, busy = (np.concatenate([x, y]) for x, y in zip((a, wall, busy), anchors[:3], strict=True))
        return fit_with_contention(a, wall, busy, fit, loss)
    loss = loss or relative_loss
    scale = scale or mean_ratio
    if anchors is not None:
        anchor_work = anchors[3] if (anchors[3] > 0).all() else anchors[1]
        shape_a, shape_cpu, shape_busy = (np.concatenate([x, y]) for x, y in
                                          zip((a, cpu, busy), (anchors[0], anchor_work, anchors[2]), strict=True))
    else:
        shape_a, shape_cpu, shape_busy = a, cpu, busy
    c_work, _ = fit_with_contention(shape_a, shape_cpu, shape_busy, fit, loss)
    work = np.maximum(MIN_STEP_S, a @ c_work)
    best: tuple[float, float, float] | None = None
    for kappa in CONTENTION_GRID if (busy > 0).any() else (0.0,):
        slowed = work * (1.0 + kappa * busy)
        s = scale(slowed, wall)
        value = loss(s * slowed, wall)
        if best is None or value < best[0] - 1e-12:
            best = (value, s, kappa)
    return c_work * best[1], best[2]


def fits_on_cpu_time(wall: np.ndarray, cpu: np.ndarray) -> bool:
    """Every record carries the thread's CPU time and it was on a CPU for most of its
    steps (median share `MIN_CPU_SHARE`): the CPU time is the step's work. (A thread
    that mostly sleeps while another thread or device computes is timed by wall alone.)"""
    return bool(len(cpu) and (cpu > 0).all() and np.median(cpu / wall) >= MIN_CPU_SHARE)


def mean_ratio(predicted: np.ndarray, measured: np.ndarray) -> float:
    """The mean of measured / predicted: the scale that makes the model right on
    average per step, whatever the step's size."""
    return float(np.mean(measured / predicted))


def fit_step_coefficients(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """c >= 0 minimising sum(((a @ c - t) / t)^2). Columns that are all zero in the
    window keep c = 0; c0 + the best single term when the window is too small or
    rank-deficient for the rest."""
    cols = [j for j in range(a.shape[1]) if j == 0 or a[:, j].any()]
    scaled = a[:, cols] / t[:, None]
    if len(t) >= MIN_FULL_FIT and np.linalg.matrix_rank(scaled / np.linalg.norm(scaled, axis=0)) == len(cols):
        c = np.zeros(a.shape[1])
        c[cols] = nnls_relative(a[:, cols], t)
        return c
    return _fit_fixed_plus_one(a, t)


def _fit_fixed_plus_one(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    best, best_loss = np.zeros(a.shape[1]), np.inf
    best[0] = float(np.median(t))  # c0 alone: the median step
    best_loss = _relative_loss(a, t, best)
    for j in range(1, a.shape[1]):
        if not a[:, j].any():
            continue
        cols = [0, j]
        c = np.zeros(a.shape[1])
        c[cols] = nnls_relative(a[:, cols], t)
        loss = _relative_loss(a, t, c)
        if loss < best_loss - 1e-12:
            best, best_loss = c, loss
    return best


def _relative_loss(a: np.ndarray, t: np.ndarray, c: np.ndarray) -> float:
    return relative_loss(a @ c, t)


def relative_loss(predicted: np.ndarray, measured: np.ndarray) -> float:
    """sum(((predicted - measured) / measured)^2): what the policy's fits minimise."""
    return float(np.sum(((predicted - measured) / measured) ** 2))


def nnls_relative(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """c >= 0 minimising sum(((a @ c - t) / t)^2): NNLS on rows divided by t, with the
    columns scaled to unit norm so seconds-per-token and seconds-per-step coefficients
    are solved on one footing (a positive column scale keeps c >= 0 unchanged)."""
    weighted = a / t[:, None]
    norms = np.linalg.norm(weighted, axis=0)
    norms[norms == 0] = 1.0
    return nnls(weighted / norms, np.ones(len(t))) / norms


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-10) -> np.ndarray:
    """Lawson-Hanson active set: x >= 0 minimising ||a x - b||, on the normal equations
    (the few columns make each inner solve a tiny dense system)."""
    gram, atb = a.T @ a, a.T @ b
    n = len(atb)
    x, passive = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(3 * n):
        gradient = atb - gram @ x
        if passive.all() or gradient[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        x, passive = _solve_passive(gram, atb, x, passive, tol)
    return x


def _solve_passive(gram: np.ndarray, atb: np.ndarray, x: np.ndarray, passive: np.ndarray,
                   tol: float) -> tuple[np.ndarray, np.ndarray]:
    """Least squares on the passive set, stepping back toward x while a variable goes <= 0."""
    while passive.any():
        z = np.zeros_like(x)
        idx = np.flatnonzero(passive)
        z[idx] = np.linalg.lstsq(gram[np.ix_(idx, idx)], atb[idx], rcond=None)[0]
        if (z[idx] > tol).all():
            return z, passive
        blocked = passive & (z <= tol)
        alpha = np.min(x[blocked] / np.maximum(x[blocked] - z[blocked], 1e-300))
        x = x + alpha * (z - x)
        passive = passive & (x > tol)
        x[~passive] = 0.0
    return x, passive
