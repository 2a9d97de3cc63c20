"""A simulated engine replica: the real scheduler's rules over aggregate counters.

What goes into each step follows `workers/engine/scheduler.py` step by step
(step_rules.py: the token budget, decode tokens first, prompt chunks, background
prefills, KV blocks and preemption). This file times the steps: each is priced by the
calibrated step model (the same features `LLMEngine._record_step` records), times 1 + k x
the other engines of its node busy when it starts (`StepCoefficients.node_contention`,
k), as engines sharing a machine slow each other, and plus g x the node's decode rate
(`node_stream_contention`, node_load.py): the serving path streaming the node's tokens
takes the same cores.

What makes it fast: a decoding sequence is not touched per step (decode_batch.py keeps
the batch as counters), so a step costs O(1) plus the prompt chunks in it; an idle engine
schedules no event; while the batch only decodes, the steps up to the next sequence's
last token are one event (a `DecodeRun`), cut at the step in flight when work arrives,
where the real engine would admit it.
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Callable

from cluster.plan.calibration import EngineLimits
from cluster.plan.sim.decode_batch import MAX_RUN_STEPS, DecodeBatch, DecodeRun
from cluster.plan.sim.decode_batch import num_blocks as _blocks
from cluster.plan.sim.node_load import NodeStreams
from cluster.plan.sim.prefix_cache import SimPrefixCache
from cluster.plan.sim.recent import RecentDecode
from cluster.plan.sim.sequence import SimSeq
from cluster.plan.sim.step_rules import Listener, StepRules
from workers.engine.cost_model import StepCoefficients, prefill_work
from workers.engine.scheduler import MAX_PROGRESS_REPORTED

Schedule = Callable[..., None]  # EventQueue.schedule(at, callback, late=False)


class SimEngine(StepRules):
    def __init__(self, replica_id: str, role: str, limits: EngineLimits, coefficients: StepCoefficients,
                 schedule: Schedule, listener: Listener, reported: StepCoefficients | None = None) -> None:
        self.replica_id, self.role, self.limits = replica_id, role, limits
        self.block_size, self.max_num_seqs = limits.block_size, limits.max_num_seqs
        self.budget = limits.max_num_batched_tokens
        self.coefficients = coefficients
        # what its heartbeats report (a real replica's own fit; never changed): one dict for all
        self._step_model = (reported or coefficients).to_dict()
        self._c = (coefficients.fixed_s, coefficients.prefill_token_s, coefficients.prefill_attention_s,
                   coefficients.decode_seq_s, coefficients.decode_context_s)
        self._contention = coefficients.node_contention
        self._stream_contention = coefficients.node_stream_contention
        self._stretched = bool(self._contention or self._stream_contention)
        self.neighbours: list[SimEngine] = []  # the other engines of its node (the simulator sets them)
        self.node = NodeStreams()  # its node's decode rate (the simulator shares one per node)
        self._schedule, self.listener = schedule, listener
        self.cache = SimPrefixCache(limits.num_kv_blocks, limits.enable_prefix_caching)
        self.free_blocks = limits.num_kv_blocks
        self.step = 0  # the index of the next step
        self.step_ends = array("d")  # when each step ended: tokens are emitted there
        self.recent = RecentDecode()  # what its heartbeats report of the last seconds' decoding
        self._step_started = 0.0
        self.busy = False
        self.busy_s = 0.0
        self.num_preemptions = 0
        self._arrivals = itertools.count()
        self.waiting: list[SimSeq] = []  # by priority key: foreground FCFS, then background
        self.ready: list[SimSeq] = []  # imported KV waiting for blocks or a seat, FCFS
        self.prefilling: list[SimSeq] = []  # running foreground prompts, FCFS
        self.backgrounds: list[SimSeq] = []  # running background prompts, FCFS
        self.decoding = DecodeBatch(self.block_size)
        self._wait_tokens = 0  # prompt tokens (and their attention work) of the waiting prompts
        self._wait_work = 0
        self._chunks: list[tuple[SimSeq, int]] = []  # the step in flight's prompt chunks
        self._joined: list[SimSeq] = []  # imported sequences whose first token this step emits
        self._allocated = False  # this step's decode blocks are taken
        self._run: DecodeRun | None = None  # the decode-only run in flight
        self._run_version = 0  # a run cut short leaves its old end event behind: it is ignored
        self.trace: list[tuple[int, int]] | None = None  # set to a list: (prompt tokens, decodes) per step

    # -- work arriving -------------------------------------------------------------------------

    def add(self, seq: SimSeq, now: float) -> None:
        """A prompt to compute here (then decoded here unless `kv_only`)."""
        assert _blocks(seq.prompt_len + seq.output_len, self.block_size) <= self.limits.num_kv_blocks, (
            f"a request of {seq.prompt_len}+{seq.output_len} tokens cannot fit {self.limits.num_kv_blocks} blocks")
        seq.arrival = next(self._arrivals)
        self._enqueue(seq)
        self._wake(now)

    def reserve(self, seq: SimSeq) -> bool:
        """Hold blocks for a prompt another replica prefills (`LLMEngine.reserve_kv`): the
        blocks this replica's prefix cache holds are reused (and not sent), the rest
        allocated now; False when the pool has no room (the worker then prefills here)."""
        bs = self.block_size
        hit = self.cache.match(seq.hashes, (seq.prompt_len - 1) // bs)
        need = _blocks(seq.prompt_len, bs) - hit
        if need > self.free_blocks:
            return False
        self.cache.record_query(seq.prompt_len, hit * bs)
        self.free_blocks -= need
        seq.shared_blocks, seq.owned_blocks = hit, need
        return True

    def import_kv(self, seq: SimSeq, now: float) -> None:
        """A sequence whose prompt KV arrived from a prefill replica (into its reserved
        blocks, `reserve`): it decodes here."""
        seq.arrival = next(self._arrivals)
        seq.num_computed = seq.prompt_len
        self.ready.append(seq)
        self._wake(now)

    def _wake(self, now: float) -> None:
        """An idle engine starts a step now, after whatever else arrives at this instant;
        a run of decode steps ends with the step in flight."""
        if not self.busy:
            self.busy = True
            self._schedule(now, self._start_step, True)
            if self._contention:
                self._wake_neighbours(now)
        elif self._run is not None:
            self._cut_run(now)

    def _wake_neighbours(self, now: float) -> None:
        """This engine just became busy: a node neighbour's run of decode steps ends with
        its step in flight, so the steps after it are priced beside this one."""
        for other in self.neighbours:
            if other._run is not None and other._contention:
                other._cut_run(now)

    # -- one step ------------------------------------------------------------------------------

    def _start_step(self, now: float) -> None:
        k = self.step
        if self.prefilling or self.backgrounds or ((self.waiting or self.ready) and self._seats() > 0):
            chunks = self._compose(k)
        elif self._start_run(now, k):
            return
        else:
            chunks = self._chunks = []
            self._allocated = False
            self._allocate_decodes(k)
        n_dec = len(self.decoding)
        if not chunks and not n_dec:
            self.busy = False
            return
        c0, c1, c2, c3, c4 = self._c
        tokens = work = 0
        for seq, n in chunks:
            tokens += n
            work += n * (seq.num_computed + n)
        context = self.decoding.context(k)
        dt = c0 + c1 * tokens + c2 * work + c3 * n_dec + c4 * context
        if self._stretched:
            dt *= self._slowdown(now)
        self.busy = True
        self.busy_s += dt
        self._step_started = now
        if self.trace is not None:
            self.trace.append((tokens, n_dec))
        self._schedule(now + dt, self._end_step)

    # -- runs of decode-only steps -------------------------------------------------------------

    def _start_run(self, now: float, k: int) -> bool:
        """The batch only decodes (nothing waits, or nothing can take a seat before one of
        its sequences ends): cover the steps up to its next last token with one event when
        their blocks fit (else step by step, which may preempt)."""
        n_dec, batch = len(self.decoding), self.decoding
        finish = batch.next_finish()
        if not n_dec or finish is None:
            return False
        num_steps = max(1, min(MAX_RUN_STEPS, finish - k + 1))
        blocks = tuple(batch.new_blocks(k + j) for j in range(num_steps))
        need = sum(blocks)
        if need > self.free_blocks:
            return False
        self.free_blocks -= need
        c0, _, _, c3, c4 = self._c
        step_s, growth_s = c0 + c3 * n_dec + c4 * batch.context(k), c4 * n_dec
        if self._stretched:
            slowdown = self._slowdown(now)
            step_s, growth_s = step_s * slowdown, growth_s * slowdown
        self._run = DecodeRun(now, k, num_steps, step_s, growth_s, blocks)
        self._run_version += 1
        version = self._run_version
        self._schedule(self._run.end_of(num_steps - 1), lambda t: self._end_run(version, t))
        return True

    def _slowdown(self, now: float) -> float:
        """1 + k x the other engines of the node busy now + g x its decode rate: what
        sharing the node adds to a step."""
        busy = sum(1 for other in self.neighbours if other.busy) if self._contention else 0
        rate = self.node.rate(now) if self._stream_contention else 0.0
        return self.coefficients.slowdown(busy, rate)

    def _cut_run(self, now: float) -> None:
        """Work arrived (or a node neighbour woke up): the run ends with the step in flight
        (it returns later steps' blocks)."""
        run = self._run
        j = 0
        while run.end_of(j) < now:
            j += 1
        if j >= run.num_steps - 1:
            return
        self.free_blocks += sum(run.blocks[j + 1:])
        self._run = run.cut(j + 1)
        self._run_version += 1
        version = self._run_version
        self._schedule(self._run.end_of(j), lambda t: self._end_run(version, t))

    def _end_run(self, version: int, now: float) -> None:
        if version != self._run_version or self._run is None:
            return  # cut short since: a later event ends it
        run, self._run = self._run, None
        n_dec = len(self.decoding)
        for j in range(run.num_steps):
            self.step_ends.append(run.end_of(j))
            if self.trace is not None:
                self.trace.append((0, n_dec))
        self.busy_s += run.end_of(run.num_steps - 1) - run.start
        if self._stream_contention:
            self.node.add(now, n_dec * run.num_steps)
        self.recent.add(run.end_of(run.num_steps - 1), run.end_of(run.num_steps - 1) - run.start, n_dec, run.num_steps)
        last = run.first + run.num_steps - 1
        for seq in list(self.decoding.finished_by(last)):
            self._finish(seq, last, now)
        self.step = last + 1
        self._start_step(now)

    def _end_step(self, now: float) -> None:
        k = self.step
        self.step_ends.append(now)
        if self._stream_contention:
            self.node.add(now, len(self.decoding))
        if not self._chunks and self.decoding:  # a decode-only step taken alone
            self.recent.add(now, now - self._step_started, len(self.decoding))
        if self._joined:
            for seq in self._joined:
                if seq.join_step == k:  # not preempted since it joined
                    self.listener.on_first_token(seq, now)
            self._joined = []
        for seq, n in self._chunks:
            seq.num_computed += n
            if seq.num_computed >= seq.prompt_len and seq.join_step < 0 and (
                    seq in self.prefilling or seq in self.backgrounds):
                self._prompt_done(seq, k, now)
        for seq in list(self.decoding.finished_by(k)):
            self._finish(seq, k, now)
        self.step = k + 1
        self._start_step(now)

    # -- what a heartbeat reports --------------------------------------------------------------

    def stats(self, now: float | None = None) -> dict:
        """The fields `LLMEngine.stats()` puts in a heartbeat, from the counters (and, given
        the time, the recent stream gap)."""
        k, n_dec = self.step, len(self.decoding)
        prefilling = self.prefilling + self.backgrounds
        ready_context = sum(s.prompt_len + 1 for s in self.ready)
        return {
            "num_running": n_dec + len(prefilling), "num_waiting": len(self.waiting) + len(self.ready),
            "kv_blocks_free": self.free_blocks, "kv_blocks_total": self.limits.num_kv_blocks,
            "num_preemptions": self.num_preemptions,
            "prefix_cache_queries": self.cache.num_queried_tokens, "prefix_cache_hits": self.cache.num_hit_tokens,
            "prompt_tokens_waiting": self._wait_tokens + sum(s.num_uncomputed for s in prefilling),
            "prompt_attention_waiting": self._wait_work + sum(
                prefill_work(s.num_computed, s.prompt_len, self.budget)[2] for s in prefilling),
            "background_tokens_waiting": sum(s.num_uncomputed for s in self.backgrounds)
            + sum(s.num_uncomputed for s in self.waiting if s.background),
            "background_attention_waiting": sum(
                prefill_work(s.num_computed, s.prompt_len, self.budget)[2]
                for s in (*self.backgrounds, *(w for w in self.waiting if w.background))),
            "background_chunk_tokens": self._background_chunk(),
            "num_decoding": n_dec + len(self.ready),
            "decode_context_tokens": self.decoding.context(k) + ready_context,
            "decode_tokens_remaining": self.decoding.tokens_remaining(k) + sum(s.output_len for s in self.ready),
            "prefill_progress": self._progress(prefilling),
            **(self.recent.stats(now) if now is not None else {}),
            "step_model": self._step_model,
            "kv_bytes_per_token": self.limits.kv_bytes_per_token,
            "max_num_batched_tokens": self.budget,
            "max_num_seqs": self.max_num_seqs,
        }

    def _progress(self, prefilling: list[SimSeq]) -> dict[str, list[int]]:
        """`Scheduler.queue_stats`'s partly computed prompts, by their request's id."""
        started = [s for s in prefilling if s.num_computed > 0 and getattr(s.owner, "request_id", None)]
        return {s.owner.request_id: [s.num_uncomputed, prefill_work(s.num_computed, s.prompt_len, self.budget)[2]]
                for s in started[:MAX_PROGRESS_REPORTED]}

    @property
    def load(self) -> int:
        return len(self.decoding) + len(self.prefilling) + len(self.backgrounds) + len(self.waiting) + len(self.ready)
