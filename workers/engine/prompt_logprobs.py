"""Prompt logprobs: how likely the model found each prompt token, given the ones before it.

Entry `j` of a prompt's list is prompt token `j` under `log_softmax` of the raw logits
at position `j - 1` (entry 0 is None: nothing precedes it). A prompt computed in several
chunks, or recomputed after a preemption, adds each entry exactly once: a position's row
is used only when its entry is the next one missing.
"""

from __future__ import annotations

import torch

from workers.engine.sequence import Sequence, TokenLogprob


def new_prompt_logprobs(seq: Sequence) -> list[TokenLogprob | None] | None:
    """A new sequence's list: [None] (its first token) when it asks for prompt logprobs."""
    return [None] if seq.params.prompt_logprobs is not None else None


def prompt_positions(seq: Sequence, start: int, end: int) -> range:
    """Positions in [start, end) whose logits give a prompt entry still missing (the last
    prompt position predicts the first generated token, not a prompt token)."""
    if not seq.wants_prompt_logprobs:
        return range(0)
    first = max(start, len(seq.prompt_logprobs) - 1)
    return range(first, min(end, seq.num_prompt_tokens - 1))


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """`token_ids[i]` under log_softmax(logits[i]) (fp32), with the row's `k` most likely."""
    logprobs = logits.float().log_softmax(dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    top_lps, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top = [tuple(zip(i, lp, strict=True)) for i, lp in zip(top_ids.tolist(), top_lps.tolist(), strict=True)]
    return [TokenLogprob(t, lp, tp) for t, lp, tp in zip(token_ids, chosen, top, strict=True)]


def add_prompt_logprobs(seq: Sequence, positions: range, logits: torch.Tensor) -> None:
    """Append the entries of `positions` (rows of `logits`, in order) to `seq`'s list."""
    assert positions.start == len(seq.prompt_logprobs) - 1, "prompt logprobs out of order"
    next_ids = [seq.prompt_token_ids[p + 1] for p in positions]
    seq.prompt_logprobs += token_logprobs(logits, next_ids, seq.params.prompt_logprobs)
