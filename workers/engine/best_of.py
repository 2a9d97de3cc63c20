"""`best_of > n`: generate `best_of` sequences, report only the `n` most likely.

Nothing of such a request is reported while it runs (which of its sequences are
reported is known only once all have finished; OpenAI refuses to stream it too). When
the last one finishes, the `n` with the highest cumulative logprob of their generated
tokens (under the raw logits) are reported, each as one finished output carrying all its
tokens and text, re-indexed 0..n-1 in that order.
"""

from __future__ import annotations

import dataclasses

import torch

from workers.engine.sequence import RequestOutput, Sequence


def holds(seq: Sequence) -> bool:
    best_of = seq.params.best_of
    return best_of is not None and best_of > seq.params.n


def add_scores(seqs: list[Sequence], logits: torch.Tensor) -> None:
    """Add to each held sequence's `cumulative_logprob` its newest token's logprob under
    `logits[i]` (the raw logits that token was sampled from)."""
    rows = [i for i, seq in enumerate(seqs) if holds(seq)]
    if not rows:
        return
    logprobs = logits[rows].float().log_softmax(dim=-1)
    ids = torch.tensor([seqs[i].output_token_ids[-1] for i in rows], dtype=torch.long, device=logits.device)
    for i, logprob in zip(rows, logprobs.gather(1, ids[:, None])[:, 0].tolist(), strict=True):
        seqs[i].cumulative_logprob += logprob


class BestOf:
    def __init__(self) -> None:
        self._seqs: dict[str, dict[int, Sequence]] = {}  # request id -> index -> sequence
        self._outputs: dict[str, list[RequestOutput]] = {}  # held, in the order reported

    def track(self, seq: Sequence) -> None:
        """Hold `seq`'s outputs if its request is `best_of > n` and decodes here (a prompt
        whose KV goes to another engine is ranked there)."""
        if holds(seq) and seq.kv_sink is None:
            self._seqs.setdefault(seq.request_id, {})[seq.index] = seq

    def collect(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """`outputs` less the held ones, plus the best of any request that just ended."""
        passed = [out for out in outputs if out.request_id not in self._seqs]
        for out in outputs:
            if out.request_id in self._seqs:
                self._outputs.setdefault(out.request_id, []).append(out)
        for request_id in dict.fromkeys(out.request_id for out in outputs):
            if request_id in self._seqs and _all_done(self._seqs[request_id]):
                passed += self._release(request_id)
        return passed

    def _release(self, request_id: str) -> list[RequestOutput]:
        seqs = self._seqs.pop(request_id)
        held = self._outputs.pop(request_id)
        ranked = sorted(seqs.values(), key=lambda s: (-s.cumulative_logprob, s.index))
        n = ranked[0].params.n
        return [_merge([o for o in held if o.index == seq.index], index)
                for index, seq in enumerate(ranked[:n])]


def _all_done(seqs: dict[int, Sequence]) -> bool:
    """Every sequence finished, and all were forked (unless the first ended before its
    first token, when there is nothing to fork)."""
    parent = seqs[0]
    forked = len(seqs) == parent.params.num_sequences or not parent.output_token_ids
    return forked and all(s.is_finished for s in seqs.values())


def _merge(outputs: list[RequestOutput], index: int) -> RequestOutput:
    """One sequence's held outputs as a single output."""
    last = outputs[-1]
    logprobs = None if last.logprobs is None else [lp for o in outputs for lp in o.logprobs or []]
    return dataclasses.replace(
        last, new_token_ids=[t for o in outputs for t in o.new_token_ids], text="".join(o.text for o in outputs),
        logprobs=logprobs, prompt_logprobs=outputs[0].prompt_logprobs, index=index,
        queue_s=outputs[0].queue_s)
