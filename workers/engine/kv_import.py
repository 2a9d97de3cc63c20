"""A decode replica's side of a KV transfer: hold blocks for a prompt computed elsewhere,
write its layers into them as they arrive, and turn the written reservation into a
request that decodes as if prefilled here (or give the blocks back).

`LLMEngine` (llm_engine.py) composes this: the attributes below are its own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from collections.abc import Sequence as Seq

from workers.engine.best_of import BestOf
from workers.engine.best_of import holds as holds_best_of
from workers.engine.block_manager import BlockManager
from workers.engine.kv_types import ByteDigest, FirstToken, KVLayout, KVPayload, KVReservation
from workers.engine.model_runner import ModelRunner
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import Scheduler
from workers.engine.sequence import RequestOutput, Sequence, TokenLogprob


class KVImport:
    """The KV-import half of `LLMEngine`."""

    _lock: threading.RLock
    _pending: list[RequestOutput]
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    best_of: BestOf
    requests: dict[str, Sequence]
    reservations: dict[str, Sequence]
    layout: KVLayout

    _new_sequence: Callable[[str, Seq[int], SamplingParams, int | None], Sequence]
    _fork_into: Callable[[Sequence, Seq[FirstToken]], list[Sequence]]  # n > 1: the siblings of `parent`
    _append_token: Callable[[Sequence, int, TokenLogprob | None], RequestOutput]

    def reserve_kv(self, transfer_id: str, prompt_token_ids: Seq[int]) -> KVReservation | None:
        """Hold blocks for a prompt's incoming KV; None when the pool has no room now.

        Leading blocks the prefix cache already holds are reused (`num_cached_blocks`) and
        need not be sent; the hit is capped like a local one, so at least the block with
        the last prompt token is always received.
        """
        with self._lock:
            if transfer_id in self.reservations:
                raise ValueError(f"transfer id {transfer_id!r} is already reserved")
            prompt = [int(t) for t in prompt_token_ids]
            seq = Sequence(transfer_id, prompt, SamplingParams(), seed=0)
            num_hit_tokens = self.block_manager.match_prefix(seq)
            if not self.block_manager.allocate(seq, len(prompt)):
                self.block_manager.free(seq)
                return None
            self.block_manager.record_query(len(prompt), num_hit_tokens)
            self.reservations[transfer_id] = seq
            return KVReservation(transfer_id, prompt, list(seq.block_ids),
                                 num_hit_tokens // self.layout.block_size, self.layout)

    def write_kv_layer(self, reservation: KVReservation, layer_idx: int, kv: KVPayload,
                       digest: ByteDigest | None = None) -> None:
        """Copy one received layer (`layout.layer_shape(num_blocks_to_receive)`) into its blocks,
        feeding `digest` (if given) the bytes as they land (`copy_into_blocks`).

        Safe from a transport thread while `step()` runs: it touches only reserved blocks,
        which no running sequence reads or writes.
        """
        if reservation.transfer_id not in self.reservations:
            raise KeyError(f"transfer {reservation.transfer_id!r} is not reserved (cancelled?)")
        self.runner.kv_cache.write_blocks(layer_idx, reservation.block_ids[reservation.num_cached_blocks:], kv,
                                          digest)
        reservation.layers_written.add(layer_idx)

    def commit_kv(self, reservation: KVReservation, request_id: str, params: SamplingParams,
                  first_token_id: int, *, seed: int | None = None,
                  first_logprob: TokenLogprob | None = None,
                  prompt_logprobs: list[TokenLogprob | None] | None = None,
                  siblings: Seq[FirstToken] = ()) -> None:
        """Turn a fully written reservation into a request that decodes as if prefilled here.

        `first_token_id` (sampled by the prefill worker) is appended as output token 0 and
        reported by the next `step()` as the request's first output, its text made by the
        request's own detokenizer and stop rules, exactly as for a token sampled here: a
        stop string or `max_tokens=1` can end the request on it. `first_logprob` (the
        prefill worker's, with the token) is reported with it as a local run would. `prompt_logprobs` (computed
        where the prompt was) ride on that first output. `siblings` (n > 1: the first tokens
        of sequences 1.., sampled with the same logits) fork the request here, as a local
        prefill would have.
        """
        with self._lock:
            missing = set(range(self.layout.num_layers)) - reservation.layers_written
            if missing and reservation.num_blocks_to_receive:
                raise ValueError(f"transfer {reservation.transfer_id!r}: layers {sorted(missing)} not written")
            held = self.reservations.pop(reservation.transfer_id)
            try:
                seq = self._new_sequence(request_id, held.prompt_token_ids, params, seed)
            except Exception:
                self.block_manager.free(held)  # a refused commit must not strand its blocks
                raise
            seq.block_ids, seq.num_hashed_blocks = held.block_ids, held.num_hashed_blocks
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.num_cached_tokens = held.num_cached_tokens
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = prompt_logprobs
            self.block_manager.cache_full_blocks(seq)
            self.requests[seq.seq_id] = seq
            self.best_of.track(seq)
            self.scheduler.add(seq)
            children = self._fork_into(seq, siblings)  # before a parent that ends frees its blocks
            for s, lp in zip([seq, *children], [first_logprob, *(f.logprob for f in siblings)], strict=True):
                if holds_best_of(s) and lp is not None:  # the first token's score, from the prefill side
                    s.cumulative_logprob += lp.logprob
            self._pending.append(self._append_token(seq, int(first_token_id), first_logprob))
            self._pending += [self._append_token(c, f.token_id, f.logprob)
                              for c, f in zip(children, siblings, strict=True)]

    def cancel_kv(self, reservation: KVReservation) -> None:
        """Free a reservation's blocks (transfer failed or was abandoned); idempotent."""
        with self._lock:
            held = self.reservations.pop(reservation.transfer_id, None)
            if held is not None:
                self.block_manager.free(held)
