"""Continuous batching under one token budget per step (the vLLM v1 idea).

No prefill or decode phases: every step lets each running sequence catch
`num_computed_tokens` up towards `num_tokens` (one token for a decoding sequence, a chunk
for a prefilling one) until `max_num_batched_tokens` is spent, decoding sequences first,
then prefills in priority order; leftover budget admits waiting sequences. When blocks run out, the running
sequence that sorts last (lowest priority, latest arrival) is preempted: its blocks are
freed and it is recomputed later, its prefix most likely served by the prefix cache.

A background prefill (`SamplingParams.yield_to_decode`) sorts last and, in a step that
decodes, takes at most `yield_tokens` (which the engine sets from its step records so
that the chunk costs about half a decode step, `step_cost`), or its own
`prefill_chunk_tokens` when the router chose one: the streams beside it slow down by
about 1.5x instead of stalling for a whole chunk, and it still advances every step. That
chunk is reserved for the first background prefill before any foreground prompt's chunk
(never out of the decode tokens), and a waiting one is admitted past foreground prompts
that cannot be: without the reserve, a steady stream of long foreground prompts left it
no budget, step after step, and its request never answered.

A request of n sequences (n / best_of) is admitted only with n of `max_num_seqs` free: it
forks at its first token, and its forks must not wait behind requests that came later.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from workers.engine.block_manager import BlockManager
from workers.engine.cost_model import prefill_work
from workers.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # computed this step, starting at seq.num_computed_tokens

    @property
    def start(self) -> int:
        return self.seq.num_computed_tokens

    @property
    def end(self) -> int:
        return self.seq.num_computed_tokens + self.num_new_tokens

    @property
    def needs_sample(self) -> bool:
        """True when this step computes the sequence's last token, so it yields logits."""
        return self.end == self.seq.num_tokens


DEFAULT_YIELD_TOKENS = 32  # before the engine has step records to size it
MAX_PROGRESS_REPORTED = 32  # partly computed prompts a heartbeat names (`queue_stats`)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.yield_tokens = DEFAULT_YIELD_TOKENS  # a background prefill's chunk in a decoding step

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        budget = self.max_num_batched_tokens
        self._admit_ready()
        reserve = self._background_reserve(budget)
        scheduled, preempted = self._schedule_running(budget - reserve)
        budget -= sum(s.num_new_tokens for s in scheduled)
        if preempted:  # admitting now would only preempt someone again next step
            return scheduled
        scheduled += self._admit_waiting(budget - reserve, _decoding(scheduled), background=False)
        budget = self.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
        # Background prefills get what the others leave (the reserve at least), and never preempt anyone.
        scheduled += self._schedule_background(budget, _decoding(scheduled))
        budget = self.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)
        scheduled += self._admit_waiting(budget, _decoding(scheduled), background=True)
        return scheduled

    def _chunk(self, seq: Sequence, budget: int, decoding: bool) -> int:
        """Tokens `seq` computes this step: what is left of it, within the budget; a
        background prefill only its `prefill_chunk_tokens` (else `yield_tokens`) of it
        when the step decodes streams."""
        num_new = min(seq.num_uncomputed_tokens, budget)
        if decoding and _is_background(seq):
            num_new = min(num_new, max(1, seq.params.prefill_chunk_tokens or self.yield_tokens))
        return num_new

    def _background_reserve(self, budget: int) -> int:
        """The first background prefill's chunk in a decoding step (running, else the first
        waiting one with seats), kept from the foreground prompts; never the decode tokens."""
        first = self._first_background()
        if first is None:
            return 0
        num_decoding = sum(1 for s in self.running if not _is_background(s) and s.num_uncomputed_tokens == 1)
        return max(0, self._chunk(first, budget - num_decoding, True))

    def _first_background(self) -> Sequence | None:
        """The background prefill the reserve is for: the first running one, else the
        first waiting one with seats."""
        first = min((s for s in self.running if _is_background(s)), key=lambda s: s.priority_key, default=None)
        if first is None:
            first = min((s for s in self.waiting if _is_background(s) and self._has_seats(s)),
                        key=lambda s: s.priority_key, default=None)
        return first

    def _schedule_running(self, budget: int) -> tuple[list[ScheduledSeq], bool]:
        """Every running sequence but the background prefills; may preempt."""
        self.running.sort(key=lambda s: s.priority_key)
        # Decode tokens first, prefill chunks from what is left (stall-free batching): a
        # long prompt admitted before a stream takes one chunk of budget per step, never
        # the whole step, so the streams beside it keep their inter-token latency.
        order = sorted(self.running, key=lambda s: s.num_uncomputed_tokens > 1)  # stable
        scheduled: dict[str, ScheduledSeq] = {}
        preempted = False
        for seq in order:
            if budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING or _is_background(seq):
                continue  # preempted earlier in this loop, or scheduled after the others
            num_new = min(seq.num_uncomputed_tokens, budget)
            assert num_new > 0, f"running sequence {seq.request_id} has nothing to compute"
            while not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]  # sorts last: background, lowest priority, latest arrival
                self._preempt(victim)
                preempted = True
                undone = scheduled.pop(victim.seq_id, None)
                if undone is not None:
                    budget += undone.num_new_tokens
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                scheduled[seq.seq_id] = ScheduledSeq(seq, num_new)
                budget -= num_new
        return list(scheduled.values()), preempted

    def _admit_ready(self) -> None:
        """Waiting sequences that already hold all their KV (imported from a prefill
        replica) join the running batch now, ahead of waiting prompts: their next step is
        one decode token, and a decode token never queues behind prompt chunks."""
        for seq in [s for s in self.waiting if s.is_decoding and s.block_ids]:
            if not self._has_seats(seq):
                break
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _schedule_background(self, budget: int, decoding: bool) -> list[ScheduledSeq]:
        scheduled: list[ScheduledSeq] = []
        for seq in [s for s in self.running if _is_background(s)]:
            if budget <= 0:
                break
            num_new = self._chunk(seq, budget, decoding)
            if not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                break  # it waits for blocks rather than take anyone's
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return scheduled

    def _admit_waiting(self, budget: int, decoding: bool, background: bool) -> list[ScheduledSeq]:
        """Waiting sequences in priority order: the foreground ones, or the background ones."""
        self.waiting.sort(key=lambda s: s.priority_key)
        scheduled: list[ScheduledSeq] = []
        for seq in [s for s in self.waiting if _is_background(s) == background]:
            if budget <= 0 or not self._has_seats(seq):
                break
            is_fresh = not seq.block_ids  # imported KV arrives holding its blocks already
            # A prompt whose logprobs are wanted is computed whole (a cached block has KV
            # but no logits); its blocks still register in the prefix cache.
            if is_fresh and not seq.wants_prompt_logprobs:
                self.block_manager.match_prefix(seq)
            decoding = decoding or seq.is_decoding  # an imported prompt decodes at once
            num_new = self._chunk(seq, budget, decoding)
            if not self.block_manager.allocate(seq, seq.num_computed_tokens + num_new):
                if is_fresh:
                    self._release(seq)
                break
            if is_fresh:
                self.block_manager.record_query(seq.num_tokens, seq.num_cached_tokens)
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if is_fresh and seq.first_scheduled_time is None:  # not a recompute after preemption
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return scheduled

    def _has_seats(self, seq: Sequence) -> bool:
        """Room under `max_num_seqs` for every sequence `seq` will be; a request of more
        sequences than that is admitted into an empty batch (its forks then queue)."""
        num_taken = sum(_num_seats(s) for s in self.running)
        return num_taken + min(_num_seats(seq), self.max_num_seqs) <= self.max_num_seqs

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        self.num_preemptions += 1
        self.add(seq)

    def _release(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def finish(self, seq: Sequence, reason: str) -> None:
        """End `seq` now, from any state, and free its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def queue_stats(self) -> dict[str, int]:
        """The work queued here, for the router to predict this replica's steps with:
        what the prefilling sequences (running or waiting) must still compute before they
        decode, in tokens and in attention work at full chunks (and how much of it is
        background prefills, which drain beside the foreground prompts at their own chunk
        per step), and what the decoding ones attend to and may still generate."""
        seqs = self.running + self.waiting
        prefilling = [s for s in seqs if not s.is_decoding]
        decoding = [s for s in seqs if s.is_decoding]
        background = [s for s in prefilling if _is_background(s)]
        return {
            "prompt_tokens_waiting": sum(s.num_uncomputed_tokens for s in prefilling),
            "prompt_attention_waiting": sum(self._waiting_work(s) for s in prefilling),
            # of which background prefills
            "background_tokens_waiting": sum(s.num_uncomputed_tokens for s in background),
            "background_attention_waiting": sum(self._waiting_work(s) for s in background),
            # the chunk the first of them takes in a step that decodes (0: none waits)
            "background_chunk_tokens": self._background_chunk(),
            "num_decoding": len(decoding),
            "decode_context_tokens": sum(s.num_tokens for s in decoding),
            "decode_tokens_remaining": sum(max(0, s.params.max_tokens - len(s.output_token_ids))
                                           for s in decoding),
            "prefill_progress": self._progress(prefilling),
        }

    def _progress(self, prefilling: list[Sequence]) -> dict[str, list[int]]:
        """{engine request id: [tokens, attention work] still to compute} of the prompts
        partly computed (at most `MAX_PROGRESS_REPORTED`): a router counts the others
        whole, and without this it counts these whole too, however far along they are."""
        started = [s for s in prefilling if s.num_computed_tokens > 0 and s.index == 0]
        return {s.request_id: [s.num_uncomputed_tokens, self._waiting_work(s)]
                for s in started[:MAX_PROGRESS_REPORTED]}

    def _background_chunk(self) -> int:
        first = self._first_background() or next((s for s in self.waiting if _is_background(s)), None)
        if first is None:
            return 0
        return max(1, min(self.max_num_batched_tokens, first.params.prefill_chunk_tokens or self.yield_tokens))

    def _waiting_work(self, seq: Sequence) -> int:
        return prefill_work(seq.num_computed_tokens, seq.num_tokens, self.max_num_batched_tokens)[2]

    def held_block_tables(self) -> list[list[int]]:
        return [s.block_ids for s in self.running + self.waiting]


def _is_background(seq: Sequence) -> bool:
    """A background prefill: `yield_to_decode` and not yet generating (its decode steps,
    one token each, run with the others)."""
    return seq.params.yield_to_decode and not seq.is_decoding


def _num_seats(seq: Sequence) -> int:
    """Sequences `seq` stands for: all of its request's until it forks here at its first
    token (not when its KV and first tokens go to another engine, which forks it there)."""
    forks_here = seq.index == 0 and not seq.output_token_ids and seq.kv_sink is None
    return seq.params.num_sequences if forks_here else 1


def _decoding(scheduled: list[ScheduledSeq]) -> bool:
    return any(s.seq.is_decoding for s in scheduled)
