"""A replica's step time as a learned linear function of the work in the step.

    t = (c0                      fixed per-step overhead (launches, sampling, scheduling)
       + c1 * prompt tokens computed
       + c2 * prefill attention work   (sum over prefill chunks: chunk tokens x context)
       + c3 * decode sequences
       + c4 * context tokens attended by decode sequences)
      * (1 + k * node busy       the node's other engines computing meanwhile (node_activity.py)
           + g * node decode rate)  the node's streams lately: its serving path's CPU load

The contention factor k is what sharing the machine's cores and memory bandwidth with one
other busy engine adds to a step (0 where the replica has its node to itself, or where
its records never saw another engine busy); it is chosen from `nnls_fit.CONTENTION_GRID` by the
same loss, c fitted for each.

The stream term g is what the node's serving path (the HTTP proxy, the router, the
replicas' streams, and a load tester where it shares the machine) adds: that work grows
with the tokens streamed, and it takes the same cores. Its feature, the decode
sequence-steps a second the node's engines ran over the last `NODE_RATE_WINDOW_S`, is
not in a replica's own records; the planner computes it from all of a node's records
(`cluster/plan/records.py`) and fits g (`fit_work_then_load`), and its simulator keeps
the same rate per node. A replica's online fit leaves g at 0.

Fitted online over a sliding window of step records, minimising the relative error
sum(((pred - t) / t)^2) (weighted least squares with weights 1 / t^2, so a 5 ms decode
step counts as much as a 500 ms prefill), with every c_i >= 0 (active-set NNLS). With
few records the full fit is underdetermined, so it falls back to c0 plus the single term
that explains the records best; with none it predicts from `DEFAULT_COEFFICIENTS`.

Where the records carry the engine thread's CPU time (`StepRecord.cpu_time_s`, and the
thread was on a CPU for most of its steps), the fit is in two stages (`fit_work_then_wall`):
the shape c from CPU time, which is the step's work without the time it waited for a
core (on a crowded node that wait scatters a 2 ms step by a quarter either way while its
CPU time moves by a tenth), then one scale and k from wall time: the mean stretch the
node's other load puts on that work, on average, as the step model must predict it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np

from workers.engine.nnls_fit import MIN_STEP_S, fit_work_then_wall
from workers.engine.step_cost import StepRecord

WINDOW = 512  # step records the fit looks at
REFIT_EVERY = 32  # observations between automatic refits
NODE_RATE_WINDOW_S = 1.0  # the node decode rate counts the steps started this long before
MAX_ANCHORS = 256  # warm-up records kept in every fit of the work's shape


@dataclass(frozen=True)
class StepFeatures:
    """The work in one step, in the units the coefficients multiply."""

    prefill_tokens: float = 0.0
    prefill_attention_work: float = 0.0
    decode_seqs: float = 0.0
    decode_context_tokens: float = 0.0
    node_busy: float = 0.0  # other engines of the node busy meanwhile (scales the row, not in it)
    node_decode_rate: float = 0.0  # decode sequence-steps a second on the node lately (scales the row)

    def row(self) -> np.ndarray:
        """[1, x1, x2, x3, x4]: the design-matrix row (the 1 multiplies c0)."""
        return np.array([1.0, self.prefill_tokens, self.prefill_attention_work,
                         self.decode_seqs, self.decode_context_tokens])


@dataclass(frozen=True)
class StepCoefficients:
    """c0..c4 of the step model, seconds per unit; JSON-ready through `to_dict`."""

    fixed_s: float
    prefill_token_s: float
    prefill_attention_s: float
    decode_seq_s: float
    decode_context_s: float
    num_samples: int = 0
    node_contention: float = 0.0  # k: the step's slowdown per other busy engine of its node
    node_stream_contention: float = 0.0  # g: its slowdown per decode sequence-step a second on its node

    def vector(self) -> np.ndarray:
        return np.array([self.fixed_s, self.prefill_token_s, self.prefill_attention_s,
                         self.decode_seq_s, self.decode_context_s])

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> StepCoefficients:
        return cls(**data)

    @classmethod
    def from_vector(cls, c: np.ndarray, num_samples: int, node_contention: float = 0.0,
                    node_stream_contention: float = 0.0) -> StepCoefficients:
        return cls(*(float(v) for v in c), num_samples=num_samples, node_contention=float(node_contention),
                   node_stream_contention=float(node_stream_contention))

    def slowdown(self, node_busy: float, node_decode_rate: float = 0.0) -> float:
        """1 + k x node busy + g x node decode rate: the stretch the node puts on the work."""
        return 1.0 + self.node_contention * node_busy + self.node_stream_contention * node_decode_rate

    def slowed(self, node_busy: float) -> StepCoefficients:
        """The model as it prices a step beside `node_busy` other busy engines: c0..c4
        scaled by 1 + k x node_busy (k kept, for what one more neighbour would add)."""
        return self.scaled(self.slowdown(max(0.0, node_busy)))

    def scaled(self, factor: float) -> StepCoefficients:
        """c0..c4 times `factor`, k and the sample count kept."""
        if factor == 1.0:
            return self
        # built directly, not by `dataclasses.replace`: the router scales a model per replica per request
        return StepCoefficients(self.fixed_s * factor, self.prefill_token_s * factor,
                                self.prefill_attention_s * factor, self.decode_seq_s * factor,
                                self.decode_context_s * factor, self.num_samples, self.node_contention,
                                self.node_stream_contention)


# A cold replica with no records: a 10 ms step plus 0.1 ms per prompt token and per
# decode sequence; the first seed replaces it.
DEFAULT_COEFFICIENTS = StepCoefficients(0.010, 1e-4, 0.0, 1e-4, 0.0)


def step_features(record: StepRecord) -> StepFeatures:
    """The one mapping from a step record to the model's features.

    The record's context tokens are every sequence's end; the decode share is that less
    the prefill chunks' ends, estimated as prefill sequences x the token-weighted mean
    end (attention work / prompt tokens), which is exact for one prefill chunk a step.
    """
    prefill_tokens, work = record.num_prefill_tokens, record.prefill_attention_work
    prefill_ends = record.num_prefill_seqs * work / prefill_tokens if prefill_tokens else 0.0
    decode_context = max(0.0, record.num_context_tokens - prefill_ends)
    return StepFeatures(float(prefill_tokens), float(work), float(record.num_decode_seqs), decode_context,
                        float(record.node_busy))


def predict_step_s(c: StepCoefficients, features: StepFeatures) -> float:
    """The model's step time for `features` (never below `MIN_STEP_S`)."""
    base = float(features.row() @ c.vector())
    return max(MIN_STEP_S, base * c.slowdown(features.node_busy, features.node_decode_rate))


def predict_steps_s(c: StepCoefficients, a: np.ndarray, busy: np.ndarray,
                    rate: np.ndarray | None = None) -> np.ndarray:
    """`predict_step_s` over design rows `a`, their `node_busy` and `node_decode_rate`."""
    return np.maximum(MIN_STEP_S, (a @ c.vector()) * c.slowdown(busy, 0.0 if rate is None else rate))


def prefill_work(start: int, end: int, chunk: int) -> tuple[int, int, int]:
    """(chunks, tokens, attention work) of computing positions [start, end) in chunks of
    at most `chunk` tokens, the work counted as `LLMEngine._record_step` counts
    `prefill_attention_work` (each chunk's tokens x its end). Closed form: the router
    asks it per request and replica."""
    if chunk < 1:
        raise ValueError(f"chunk must be at least 1, got {chunk}")
    num_tokens = max(0, end - start)
    if num_tokens == 0:
        return 0, 0, 0
    num_full = (num_tokens - 1) // chunk  # every chunk but the last is full
    last_len = num_tokens - num_full * chunk
    # full chunk i (1..num_full) ends at start + i * chunk
    full_work = chunk * (num_full * start + chunk * num_full * (num_full + 1) // 2)
    return num_full + 1, num_tokens, full_work + last_len * end


def has_work(record: StepRecord) -> bool:
    return record.step_time_s > 0 and (record.num_prefill_tokens > 0 or record.num_decode_seqs > 0)


class StepCostFit:
    """Online NNLS fit of the step model over the last `window` records.

    The warm-up's records can be kept as anchors (`anchor`): they stay in the fit of the
    work's shape on CPU time for good, beside the window. A window of live steps can be
    degenerate: a long prompt prefilled in the background beside a few streams is hundreds
    of steps of one chunk size, where the cost per prompt token and the fixed cost per
    step cannot be told apart, and the fit put it all on the fixed cost, pricing a fresh
    2,000-token prompt at a fraction of its time. The warm-up covers every kind of step,
    and a step's CPU time does not move with the node's load, so the anchors pin the shape
    where the window cannot, while the scale and the contention still come from the
    window's wall time alone. (Where the fit runs on wall time, the anchors join it.)
    """

    def __init__(self, window: int = WINDOW, refit_every: int = REFIT_EVERY) -> None:
        self._rows: deque[np.ndarray] = deque(maxlen=window)
        self._times: deque[float] = deque(maxlen=window)
        self._busy: deque[float] = deque(maxlen=window)
        self._cpu: deque[float] = deque(maxlen=window)
        self._refit_every = refit_every
        self._since_fit = 0
        self._coefficients = DEFAULT_COEFFICIENTS
        self._anchors: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None  # rows, wall, busy, cpu

    def anchor(self) -> None:
        """Keep the window's records (the warm-up's) in every later fit (at most the
        last `MAX_ANCHORS`)."""
        if not self._times:
            return
        keep = slice(-MAX_ANCHORS, None)
        self._anchors = (np.stack(self._rows)[keep], np.array(self._times)[keep], np.array(self._busy)[keep],
                         np.array(self._cpu)[keep])

    @property
    def num_anchors(self) -> int:
        return 0 if self._anchors is None else len(self._anchors[1])

    @property
    def coefficients(self) -> StepCoefficients:
        return self._coefficients

    @property
    def num_samples(self) -> int:
        return len(self._times)

    def observe(self, record: StepRecord) -> None:
        """Add a record to the window (steps without work are skipped); refit every
        `refit_every` observations, and sooner while the window is young (at about
        every doubling) so early coefficients improve as fast as the records come."""
        if not has_work(record):
            return
        self._rows.append(step_features(record).row())
        self._times.append(record.step_time_s)
        self._busy.append(record.node_busy)
        self._cpu.append(record.cpu_time_s)
        self._since_fit += 1
        if self._since_fit >= min(self._refit_every, max(1, self.num_samples // 2)):
            self.fit()

    def seed(self, records: Iterable[StepRecord]) -> StepCoefficients:
        """Start from warm-up steps: observe them all and fit now."""
        for record in records:
            self.observe(record)
        return self.fit()

    def fit(self) -> StepCoefficients:
        """Refit on the window; keeps the previous coefficients when it is empty."""
        self._since_fit = 0
        if not self._times:
            return self._coefficients
        a, t, busy = np.stack(self._rows), np.array(self._times), np.array(self._busy)
        c, kappa = fit_work_then_wall(a, t, np.array(self._cpu), busy, anchors=self._anchors)
        self._coefficients = StepCoefficients.from_vector(c, len(t), kappa)
        return self._coefficients

    def predict(self, features: StepFeatures) -> float:
        """Predicted step time in seconds."""
        return predict_step_s(self._coefficients, features)

    def predict_record(self, record: StepRecord) -> float:
        return self.predict(step_features(record))

    def median_relative_error(self, records: Iterable[StepRecord]) -> float:
        """median |pred - t| / t over the records with work (nan when there are none)."""
        errors = [abs(self.predict_record(r) - r.step_time_s) / r.step_time_s
                  for r in records if has_work(r)]
        return float(np.median(errors)) if errors else float("nan")
