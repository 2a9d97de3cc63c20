"""The real scheduler's rules, as the simulated engine applies them to its counters.

`SimEngine` (engine.py) times steps and runs of steps; what goes into each step follows
`workers/engine/scheduler.py` and lives here: the token budget filled with decode tokens
first, imported KV joining ahead of waiting prompts, the running prompts' chunks in FCFS
order, waiting prompts admitted while there are seats and blocks, background prefills
at their chunk size in a step that decodes (the first one's chunk reserved before the
foreground prompts'), and, when a step's blocks run out, the running sequence that sorts
last preempted and queued to be recomputed.
"""

from __future__ import annotations

from typing import Protocol

from cluster.plan.calibration import EngineLimits
from cluster.plan.sim.decode_batch import DecodeBatch
from cluster.plan.sim.decode_batch import num_blocks as _blocks
from cluster.plan.sim.prefix_cache import SimPrefixCache
from cluster.plan.sim.sequence import SimSeq
from workers.engine.cost_model import prefill_work
from workers.engine.scheduler import DEFAULT_YIELD_TOKENS
from workers.engine.step_cost import YIELD_STEP_FRACTION


class Listener(Protocol):
    def on_first_token(self, seq: SimSeq, now: float) -> None: ...
    def on_prefilled(self, seq: SimSeq, now: float) -> None: ...  # a remote prefill's KV is ready to send
    def on_finished(self, seq: SimSeq, now: float) -> None: ...


class StepRules:
    """The composing half of `SimEngine`: its queues and blocks, set by its `__init__`."""

    limits: EngineLimits
    block_size: int
    max_num_seqs: int
    budget: int
    step: int
    free_blocks: int
    num_preemptions: int
    cache: SimPrefixCache
    waiting: list[SimSeq]
    ready: list[SimSeq]
    prefilling: list[SimSeq]
    backgrounds: list[SimSeq]
    decoding: DecodeBatch
    listener: Listener
    _c: tuple[float, float, float, float, float]
    _wait_tokens: int
    _wait_work: int
    _chunks: list[tuple[SimSeq, int]]
    _joined: list[SimSeq]
    _allocated: bool

    def _seats(self) -> int:
        return self.max_num_seqs - len(self.decoding) - len(self.prefilling) - len(self.backgrounds)

    def _enqueue(self, seq: SimSeq) -> None:
        seq.num_computed = seq.shared_blocks = seq.owned_blocks = 0
        key = seq.priority_key
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority_key > key:  # nearly always appends
            i -= 1
        self.waiting.insert(i, seq)
        self._wait_tokens += seq.prompt_len
        self._wait_work += prefill_work(0, seq.prompt_len, self.budget)[2]

    # -- composing a step ----------------------------------------------------------------------

    def _compose(self, k: int) -> list[tuple[SimSeq, int]]:
        """The step's prompt chunks, in the real scheduler's order (its decodes are the batch)."""
        chunks: list[tuple[SimSeq, int]] = []
        self._chunks, self._allocated = chunks, False
        self._admit_ready(k)
        preempted = self._allocate_decodes(k)
        reserve = self._background_reserve()
        preempted = self._run_prefills(k, chunks, reserve) or preempted
        if not preempted:
            decoding = bool(self.decoding)
            self._admit_waiting(chunks, background=False, decoding=decoding, reserve=reserve)
            self._run_backgrounds(chunks, decoding)
            self._admit_waiting(chunks, background=True, decoding=decoding)
        return chunks


    def _admit_ready(self, k: int) -> None:
        """Imported KV joins the batch ahead of waiting prompts (`Scheduler._admit_ready`)."""
        while self.ready:
            seq = self.ready[0]
            if not seq.owned_blocks:
                need = _blocks(seq.prompt_len, self.block_size) - seq.shared_blocks
                if need > self.free_blocks:
                    return
                self.free_blocks -= need
                seq.owned_blocks = need
            if self._seats() <= 0:
                return
            self.ready.pop(0)
            seq.segments.append((k, -1))
            self.decoding.join(seq, k, seq.prompt_len, seq.output_len)
            self._joined.append(seq)

    def _allocate_decodes(self, k: int) -> bool:
        """This step's new decode blocks; preempt the last-sorting sequence while they do not fit."""
        preempted = False
        while self.decoding.new_blocks(k) > self.free_blocks:
            self._preempt(self._victim(), k)
            preempted = True
        self.free_blocks -= self.decoding.new_blocks(k)
        self._allocated = True
        return preempted

    def _background_reserve(self) -> int:
        """The first background prefill's chunk in a decoding step (running, else the first
        waiting one, with a seat), kept from the foreground prompts (`Scheduler._background_reserve`)."""
        first = self.backgrounds[0] if self.backgrounds else None
        if first is None and self._seats() > 0:
            first = next((s for s in self.waiting if s.background), None)
        if first is None:
            return 0
        return max(0, self._chunk(first, self.budget - len(self.decoding), True))

    def _background_chunk(self) -> int:
        """The first background prefill's chunk in a decoding step (0: none waits)."""
        first = self.backgrounds[0] if self.backgrounds else next((s for s in self.waiting if s.background), None)
        if first is None:
            return 0
        return max(1, min(self.budget, first.chunk_tokens or self._yield_tokens()))

    def _run_prefills(self, k: int, chunks: list[tuple[SimSeq, int]], reserve: int = 0) -> bool:
        preempted = False
        for seq in list(self.prefilling):
            budget = self.budget - len(self.decoding) - sum(n for _, n in chunks) - reserve
            if budget <= 0:
                break
            if seq not in self.prefilling:
                continue  # preempted earlier in this loop
            n = min(seq.num_uncomputed, budget)
            need = _blocks(seq.num_computed + n, self.block_size) - seq.shared_blocks - seq.owned_blocks
            while need > self.free_blocks:
                victim = self._victim()
                self._preempt(victim, k)
                preempted = True
                if victim is seq:
                    break
            if seq in self.prefilling:
                self.free_blocks -= need
                seq.owned_blocks += need
                chunks.append((seq, n))
        return preempted

    def _chunk(self, seq: SimSeq, budget: int, decoding: bool) -> int:
        n = min(seq.num_uncomputed, budget)
        if decoding and seq.background:
            n = min(n, max(1, seq.chunk_tokens or self._yield_tokens()))
        return n

    def _yield_tokens(self) -> int:
        """The engine's background chunk when the router named none: prompt tokens that
        cost `YIELD_STEP_FRACTION` of a decode step (`StepCostModel.yield_tokens`). Node
        contention slows the decode step and the prompt token alike (the real engine times
        both), so it leaves the ratio as it is."""
        c0, c1, _, c3, c4 = self._c
        n_dec = len(self.decoding)
        decode_step = c0 + c3 * n_dec + c4 * self.decoding.context(self.step)
        if c1 <= 0 or decode_step <= 0:
            return DEFAULT_YIELD_TOKENS
        return max(1, min(self.budget, int(YIELD_STEP_FRACTION * decode_step / c1)))

    def _run_backgrounds(self, chunks: list[tuple[SimSeq, int]], decoding: bool) -> None:
        for seq in self.backgrounds:
            budget = self.budget - len(self.decoding) - sum(n for _, n in chunks)
            if budget <= 0:
                return
            n = self._chunk(seq, budget, decoding)
            need = _blocks(seq.num_computed + n, self.block_size) - seq.shared_blocks - seq.owned_blocks
            if need > self.free_blocks:
                return  # it waits for blocks rather than take anyone's
            self.free_blocks -= need
            seq.owned_blocks += need
            chunks.append((seq, n))

    def _admit_waiting(self, chunks: list[tuple[SimSeq, int]], background: bool, decoding: bool,
                       reserve: int = 0) -> None:
        bs = self.block_size
        while True:
            budget = self.budget - len(self.decoding) - sum(n for _, n in chunks) - reserve
            seq = next((s for s in self.waiting if s.background == background), None)
            if seq is None or budget <= 0 or self._seats() <= 0:
                return
            hit = self.cache.match(seq.hashes, (seq.prompt_len - 1) // bs)
            seq.shared_blocks, seq.num_computed = hit, hit * bs
            n = self._chunk(seq, budget, decoding)
            need = _blocks(seq.num_computed + n, bs) - hit
            if need > self.free_blocks:
                seq.shared_blocks = seq.num_computed = 0
                return
            self.cache.record_query(seq.prompt_len, hit * bs)
            self.waiting.remove(seq)
            self._wait_tokens -= seq.prompt_len
            self._wait_work -= prefill_work(0, seq.prompt_len, self.budget)[2]
            self.free_blocks -= need
            seq.owned_blocks = need
            (self.backgrounds if background else self.prefilling).append(seq)
            chunks.append((seq, n))

    # -- sequences changing state --------------------------------------------------------------

    def _prompt_done(self, seq: SimSeq, k: int, now: float) -> None:
        """The step that computed a prompt's last token sampled its next token."""
        self.cache.insert(seq.hashes)
        (self.backgrounds if seq in self.backgrounds else self.prefilling).remove(seq)
        if seq.kv_only:
            self.free_blocks += seq.owned_blocks
            seq.owned_blocks = 0
            self.listener.on_prefilled(seq, now)
            return
        seq.num_emitted += 1
        if seq.num_emitted == 1:
            self.listener.on_first_token(seq, now)
        left = seq.output_len - seq.num_emitted
        if left <= 0:
            seq.segments.append((k, k))
            self.free_blocks += seq.owned_blocks
            seq.owned_blocks = 0
            self.listener.on_finished(seq, now)
            return
        seq.segments.append((k, -1))
        self.decoding.join(seq, k + 1, seq.prompt_len, left)

    def _finish(self, seq: SimSeq, k: int, now: float) -> None:
        self.free_blocks += self.decoding.leave(seq, k, allocated=True)
        seq.segments[-1] = (seq.segments[-1][0], k)
        seq.num_emitted = seq.output_len
        seq.join_step = -1
        self.listener.on_finished(seq, now)

    def _victim(self) -> SimSeq:
        """The running sequence that sorts last (`Scheduler.running[-1]`): background
        requests (still prefilling or decoding since) first, then the latest arrival."""
        return max([*self.backgrounds, *self.decoding.seqs.values(), *self.prefilling], key=lambda s: s.priority_key)

    def _preempt(self, seq: SimSeq, k: int) -> None:
        """Free `seq`'s blocks; it waits to be recomputed, tokens it emitted included."""
        if seq.decoding:
            self.free_blocks += self.decoding.leave(seq, k, self._allocated)
            start = seq.segments[-1][0]
            if k - 1 >= start:
                seq.segments[-1] = (start, k - 1)
            else:
                seq.segments.pop()
            seq.num_emitted = seq.emitted_at(k)
            seq.prompt_len = seq.context_at(k) + 1
            seq.join_step = -1
        else:
            (self.backgrounds if seq in self.backgrounds else self.prefilling).remove(seq)
            self.free_blocks += seq.owned_blocks
        self.num_preemptions += 1
        self._enqueue(seq)
