"""Requests still prefilling on another replica that already count as streams where they
will decode.

One counts once its predicted first token is nearer than its own predicted decode lasts
(`incoming_horizon_s`), or it is late: it joins that replica's batch inside the life of a
stream placed there now. One behind a long remote queue does not; counting it made an
overloaded prefill pool look like streams on every decode replica, which pushed yet
more prompts onto that queue.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from router.placement import Placement

INCOMING_HORIZON_S = 5.0  # at most this near, a remote request counts where it will decode


def due_soon(placements: Iterable[Placement], now: float | None) -> tuple[int, int]:
    """(sequences, their context tokens) of `placements` (prefilling elsewhere) that count
    as streams where they decode: with `now`, only those due within `incoming_horizon_s`
    or late; without it, all."""
    seqs = context = 0
    for p in placements:
        prediction = p.decision.prediction
        if now is None or prediction is None or \
                p.placed_at + prediction.ttft_s <= now + incoming_horizon_s(p.max_tokens, prediction.tpot_s):
            seqs += p.num_sequences
            context += p.num_sequences * p.prompt_len
    return seqs, context


def due_later(placements: Iterable[Placement], now: float) -> tuple[float, ...]:
    """Ascending, once per sequence: seconds until the predicted first token of each of
    `placements` (prefilling elsewhere) that `due_soon` does not count yet, within
    `INCOMING_HORIZON_S`. Each starts decoding there while a prompt prefilled there now
    may still hold its steps (`predict.local`)."""
    out = []
    for p in placements:
        prediction = p.decision.prediction
        if prediction is None:
            continue
        due = p.placed_at + prediction.ttft_s - now
        if incoming_horizon_s(p.max_tokens, prediction.tpot_s) < due <= INCOMING_HORIZON_S:
            out += [due] * p.num_sequences
    return tuple(sorted(out))


def incoming_horizon_s(max_tokens: int, tpot_s: float) -> float:
    """How soon a request prefilling elsewhere must be due to count as a stream where it
    will decode: within its own predicted decode (at most `INCOMING_HORIZON_S`). Long
    prompts of 16 tokens each, one every 0.6 s behind a 3-7 s remote queue, counted 5-8
    streams on a decode replica that decoded one or two at a time (bench cluster, load
    shift): its steps looked 2-3x their length, and a background prefill there had to
    shrink its chunk to a token."""
    decode_s = max(max_tokens - 1, 0) * tpot_s
    return min(INCOMING_HORIZON_S, decode_s) if math.isfinite(decode_s) else INCOMING_HORIZON_S
