"""The shapes pricing works in: a request as pricing sees it (`RequestShape`), what one
way of running it is predicted to cost (`Prediction`), and that way with its replicas
(`Candidate`), which also names the key its predictions are corrected under
(router/corrections.py). The arithmetic that fills them is router/predict.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

Kind = Literal["remote", "local", "background", "whole"]
# Prompts computing at least this many tokens learn their TTFT corrections apart
# (`Candidate.ttft_learned_as`): a short prompt's TTFT is mostly the steps and hops around
# its prefill, a long one's is the prefill, and each errs its own way. One short remote
# prefill at twice its predicted 132 ms made the next 1,496-token prompt's remote TTFT
# look 1.4x its 1.7 s, and that prompt prefilled on the decode replica instead, ahead of
# four short requests that then missed their 215 ms objective.
LONG_PROMPT_TOKENS = 512
LONG_PROMPT_KEY = ":long"


@dataclass(frozen=True)
class RequestShape:
    """One request as pricing sees it."""

    prompt_len: int
    max_tokens: int
    num_sequences: int = 1
    decode_cost: float = 1.0  # plain decode tokens per step per sequence (a grammar costs more)
    prompt_logprobs: bool = False  # computed whole: no prefix-cache hit


@dataclass(frozen=True)
class Prediction:
    ttft_s: float
    tpot_s: float  # this request's mean gap after its first token
    streams_tpot_s: float = 0.0  # the streams already decoding beside it (0: none)
    transfer_s: float = 0.0  # the part of `ttft_s` that is the KV's exposed transfer tail
    # `remote`: the streams decoding on the prefill replica itself (requests run whole
    # there), which its prompt's chunks stall (0: none)
    host_streams_tpot_s: float = 0.0

    def scaled(self, ttft: float, tpot: float, overdue: float = 1.0, streams: float | None = None,
               host_streams: float = 1.0, hop_s: float = 0.0) -> Prediction:
        """`ttft` rescales what the step models priced (the link's cost has its own fit,
        which follows a changed link by itself); `overdue` the whole TTFT; `streams` the
        streams' TPOT (default: as `tpot`); `host_streams` those on the prefill replica;
        `hop_s` (the router's own time and its path to the replica and back) is added."""
        ttft_s = scale_ttft(self.ttft_s, self.transfer_s, ttft) * overdue + hop_s
        streams_tpot_s = self.streams_tpot_s * (tpot if streams is None else streams)
        return Prediction(ttft_s, self.tpot_s * tpot, streams_tpot_s, self.transfer_s * overdue,
                          self.host_streams_tpot_s * host_streams)

    def with_tail_at_least(self, tail_s: float) -> Prediction:
        """This prediction with its transfer tail raised to `tail_s` (itself when it is as slow)."""
        if tail_s <= self.transfer_s:
            return self
        return replace(self, ttft_s=self.ttft_s + tail_s - self.transfer_s, transfer_s=tail_s)


def scale_ttft(ttft_s: float, transfer_s: float, factor: float) -> float:
    """TTFT with its step-model part rescaled by `factor`, its transfer tail as fitted."""
    return (ttft_s - transfer_s) * factor + transfer_s


@dataclass(frozen=True)
class Candidate:
    kind: Kind
    decode_replica: str  # where it decodes (the prefill replica itself for `whole`)
    prefill_replica: str  # where its prompt is computed
    prediction: Prediction
    chunk_tokens: int | None = None  # `background`: the prompt tokens per decoding step
    num_streams: int = 0  # the streams beside it
    # `remote`: the streams on the prefill replica itself (requests run whole there)
    host_streams: int = 0
    overdue_x: float = 1.0  # the prefill replica's `ReplicaLoad.overdue` on this route (a correction)
    # requests expected to start decoding beside it while its chunks slow the decode
    # replica's steps: as many as were placed there over as long lately, plus those
    # prefilling elsewhere that are due there meanwhile (`ReplicaLoad.incoming_due_s`)
    joining_streams: float = 0.0
    # seconds its prompt holds the decode replica's foreground lane (`local`): the prompts
    # placed there meanwhile wait behind it
    blocking_s: float = 0.0
    computed_tokens: int = 0  # the prompt tokens its prefill computes (the rest are cached)
    # `remote`: seconds until its prompt's last chunk on the prefill replica (the queue
    # ahead of it included), and the part its own chunks take: every prompt placed there
    # meanwhile waits that much longer
    prefill_done_s: float = 0.0
    prefill_own_s: float = 0.0

    @property
    def route(self) -> str:
        return "disagg" if self.kind == "remote" else "local"

    @property
    def learned_as(self) -> str:
        """The key its predictions are corrected under (router/corrections.py): its route,
        but a background prefill apart from the foreground ones. Its TTFT runs at the
        small chunk it shares the decode replica's steps with, and its prediction errs
        unlike theirs. Corrected by the foreground's factors, a background prefill of a
        1,496-token prompt was predicted 3.6 s instead of about 10 s, and its streams' TPOT
        half of what they then saw. A background prompt that fits in one chunk yields to
        nobody: it runs in one step as a foreground one does, and is corrected as one.
        Corrected apart, short prompts looked a third quicker in the background than in
        the foreground on the same replica, and took the background lane at a tight TTFT
        objective where every fixed configuration computes them in the foreground."""
        return "background" if self.yields else self.route

    @property
    def yields(self) -> bool:
        """A background prefill that takes more than one chunk (it yields to the streams)."""
        return self.kind == "background" and self.computed_tokens > (self.chunk_tokens or 0)

    @property
    def ttft_learned_as(self) -> str:
        """The key its TTFT is corrected under: `learned_as`, long prompts apart
        (`LONG_PROMPT_TOKENS`)."""
        return self.learned_as + LONG_PROMPT_KEY if self.computed_tokens >= LONG_PROMPT_TOKENS else self.learned_as
