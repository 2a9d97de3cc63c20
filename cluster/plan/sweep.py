"""An offline profiling sweep: run `LLMEngine` on this machine over the kinds of step the
scheduler produces and keep the `StepRecord`s the engine writes for each.

Three kinds of point, each run through the engine's own `add_request` / `step` path:

- prefill: a chunk of `prompt_len` new tokens at a context of `context` tokens. The
  context is a prompt run just before and left in the prefix cache, so the chunk attends
  to it exactly as a later chunk of a long prompt does.
- decode: `batch` sequences with prompts of `context_lo` to `context` tokens (drawn
  log-uniformly: a decode replica's batch holds short and long sequences together),
  decoding together for `DECODE_STEPS` steps (their prefill steps are recorded too).
- mixed: the same decoding batch, and a prompt of `prompt_len` tokens added once it
  decodes, so some steps compute a prompt chunk beside the decodes.

The grid spans chunk sizes up to the token budget, contexts up to half the model's
context length, and batches up to `max_num_seqs`, each clipped to what the KV pool
holds; `max_points` keeps the cheapest points of each kind (a quick sweep for tests).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from workers.engine.sampling_params import SamplingParams
from workers.engine.step_cost import StepRecord

if TYPE_CHECKING:
    from workers.engine.llm_engine import LLMEngine

DECODE_STEPS = 16  # tokens each decode point's sequences generate
REPEATS = 5  # recorded passes over the grid (the same lengths, other token ids)
CHUNK_LENS = (16, 32, 64, 128, 256, 512, 1024)
CONTEXTS = (0, 128, 512, 2048)
BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DECODE_CONTEXTS = ((64, 256), (256, 2048), (64, 2048))  # (shortest, longest) prompt of a batch
MAX_DECODE_TOKENS = 32_768  # batch x context of one decode point (its prefill dominates beyond)
MIXED = ((4, 128, 64), (16, 512, 256), (8, 1024, 32), (32, 128, 512))  # (batch, context, prompt)
KV_FILL = 0.8  # a point uses at most this share of the KV pool
MIN_CPU_SHARE = 0.8  # a step whose thread had a core for less of its wall time was contended

Kind = Literal["prefill", "decode", "mixed"]
OnPoint = Callable[[int, int], None]  # (points done, points in all)


@dataclass(frozen=True)
class SweepPoint:
    kind: Kind
    batch: int  # decoding sequences (1 for a prefill point)
    context: int  # tokens already in the cache / the longest decoding sequence's prompt
    prompt_len: int  # the prompt chunk's new tokens (0 for a decode point)
    context_lo: int = 0  # the shortest decoding sequence's prompt (decode: drawn in between)


def sweep_grid(engine: LLMEngine, max_points: int | None = None) -> list[SweepPoint]:
    """Every point the engine's limits allow, interleaved by kind; with `max_points`,
    that many of the cheapest of each kind in turn."""
    budget = engine.scheduler.max_num_batched_tokens
    max_len = engine.runner.max_model_len
    capacity = int(KV_FILL * engine.block_manager.num_blocks * engine.layout.block_size)
    prefill = [SweepPoint("prefill", 1, c, n) for c in CONTEXTS for n in CHUNK_LENS
               if n <= budget and c + n <= min(max_len // 2 + n, capacity)]
    decode = [SweepPoint("decode", b, hi, 0, lo) for b in BATCHES for lo, hi in DECODE_CONTEXTS
              if b <= engine.scheduler.max_num_seqs and hi + DECODE_STEPS <= max_len // 2
              and b * hi <= 2 * MAX_DECODE_TOKENS and b * (hi + DECODE_STEPS) <= capacity]
    mixed = [SweepPoint("mixed", b, c, n) for b, c, n in MIXED
             if b + 1 <= engine.scheduler.max_num_seqs and n <= budget
             and b * (c + 2 * DECODE_STEPS) + n <= capacity and c + 2 * DECODE_STEPS <= max_len // 2]
    if max_points is None:
        return _interleave(prefill, decode, mixed)
    return _interleave(*(sorted(kind, key=_tokens) for kind in (prefill, decode, mixed)))[:max_points]


def _tokens(point: SweepPoint) -> int:
    """About the tokens a point computes: what its run time goes with."""
    return point.batch * point.context + point.prompt_len + (point.context if point.kind == "prefill" else 0)


def _interleave(*lists: list[SweepPoint]) -> list[SweepPoint]:
    out = []
    for i in range(max(len(x) for x in lists)):
        out += [x[i] for x in lists if i < len(x)]
    return out


@dataclass
class SweepResult:
    records: list[StepRecord] = field(default_factory=list)  # the steps kept, in order
    num_contended: int = 0  # steps left out: the thread had the CPU for too little of them
    num_unaligned: int = 0  # points whose repeats scheduled different steps (all their steps kept)

    def add_point(self, runs: list[list[tuple[StepRecord, bool]]]) -> None:
        """Per step position, the record of median time among the point's repeats (which
        ran the same shapes, so the same steps); a repeat's step that was contended does
        not count. Repeats that scheduled different steps keep all their records."""
        if not _aligned(runs):
            self.num_unaligned += 1
            for run in runs:
                self._add([r for r, contended in run if not contended], sum(c for _, c in run))
            return
        for column in zip(*runs, strict=True):
            kept = sorted((r for r, contended in column if not contended), key=lambda r: r.step_time_s)
            self._add(kept[(len(kept) - 1) // 2:][:1], 0 if kept else 1)

    def _add(self, records: list[StepRecord], num_contended: int) -> None:
        self.records += records
        self.num_contended += num_contended


def _aligned(runs: list[list[tuple[StepRecord, bool]]]) -> bool:
    def shape(r: StepRecord) -> tuple:
        return r.num_prefill_tokens, r.num_decode_seqs, r.num_context_tokens, r.prefill_attention_work

    return len({tuple(shape(r) for r, _ in run) for run in runs}) == 1


def run_sweep(engine: LLMEngine, points: list[SweepPoint], seed: int = 0, on_point: OnPoint | None = None,
              check_contention: bool = True) -> SweepResult:
    """Run every point on an idle engine and keep, per step, a typical record of it.

    The grid runs `REPEATS + 1` times over, the first pass unrecorded (a shape's first
    steps pay one-time costs). A point runs the same lengths in every pass (other token
    ids, so the prefix cache does not help), and each of its steps keeps the record of
    median time among the passes: the passes are seconds apart, so a stretch of work by
    another process on this machine slows one pass of a point, not the profile. A first
    small request wakes the model (lazy initialisation, allocator growth). With
    `check_contention` (a CPU engine on one torch thread: the whole step runs on the
    calling thread), a pass's step whose thread ran on a core for less than
    `MIN_CPU_SHARE` of its wall time does not count either: another process had the
    core. (A live deployment's records keep their contention: it is the deployment's.)
    `on_point(done, total)` counts point runs over all passes."""
    rng = random.Random(seed)
    sweeper = _Sweeper(engine, rng, check_contention)
    sweeper.run_requests([(engine.layout.block_size, 2)])
    shape_seeds = [rng.randrange(1 << 30) for _ in points]
    runs: list[list[list[tuple[StepRecord, bool]]]] = [[] for _ in points]
    total = (REPEATS + 1) * len(points)
    for done, (repeat, i) in enumerate(((r, i) for r in range(REPEATS + 1) for i in range(len(points))), 1):
        steps = sweeper.run_point(points[i], shape_seeds[i])
        if repeat:
            runs[i].append(steps)
        if on_point is not None:
            on_point(done, total)
    engine.step_records.clear()
    result = SweepResult()
    for point_runs in runs:
        result.add_point(point_runs)
    return result


class _Sweeper:
    def __init__(self, engine: LLMEngine, rng: random.Random, check_contention: bool) -> None:
        self.engine, self.rng, self.check_contention = engine, rng, check_contention
        self.steps: list[tuple[StepRecord, bool]] = []  # (record, contended) of the run going on

    def run_point(self, point: SweepPoint, shape_seed: int) -> list[tuple[StepRecord, bool]]:
        """Run one repeat of `point`; its lengths come from `shape_seed`, its token ids
        from the sweep's own generator. Returns its steps with work, in order."""
        self.steps = []
        shapes = random.Random(shape_seed)
        if point.kind == "prefill":
            context = self.random_prompt(point.context) if point.context else []
            if context:  # computed now and left in the prefix cache for the chunk to attend to
                self.run_requests([], prompts=[(context, 1)])
            self.run_requests([], prompts=[(context + self.random_prompt(point.prompt_len), 1)])
        elif point.kind == "decode":
            self.run_requests([(_log_uniform(shapes, point.context_lo, point.context), DECODE_STEPS)
                               for _ in range(point.batch)])
        else:
            late = (self.random_prompt(point.prompt_len), 2)
            self.run_requests([(point.context, 2 * DECODE_STEPS)] * point.batch, late=late)
        return self.steps

    def random_prompt(self, length: int) -> list[int]:
        engine = self.engine
        vocab_size = min(engine.runner.model.config.vocab_size, len(engine.tokenizer))  # ids that detokenize
        return [self.rng.randrange(vocab_size) for _ in range(length)]

    def run_requests(self, shapes: list[tuple[int, int]], prompts: list[tuple[list[int], int]] | None = None,
                     late: tuple[list[int], int] | None = None) -> None:
        """Add random prompts of (length, max_tokens) (or the given (prompt, max_tokens))
        and step until all finish; `late` joins at the first step where every other one decodes."""
        engine = self.engine
        todo = list(prompts or []) + [(self.random_prompt(n), m) for n, m in shapes]
        base = f"sweep-{time.monotonic_ns()}"
        for i, (prompt, max_tokens) in enumerate(todo):
            engine.add_request(f"{base}-{i}", prompt, _params(self.rng, max_tokens))
        while engine.has_unfinished_requests():
            if late is not None and all(seq.is_decoding for seq in engine.requests.values()):
                engine.add_request(f"{base}-late", late[0], _params(self.rng, late[1]))
                late = None
            self.step()

    def step(self) -> None:
        engine = self.engine
        last = engine.step_records[-1] if engine.step_records else None
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        engine.step()
        cpu_share = (time.thread_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
        new = engine.step_records[-1] if engine.step_records else None
        if new is not None and new is not last and (new.num_prefill_tokens or new.num_decode_seqs):
            self.steps.append((new, self.check_contention and cpu_share < MIN_CPU_SHARE))


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(max(1, lo)), math.log(max(1, hi))))))


def _params(rng: random.Random, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, seed=rng.randrange(1 << 30))
