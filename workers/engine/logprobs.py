"""Log-probabilities of chosen tokens under the model's raw logits, with the top alternatives.

Raw means before logit bias, penalties, a grammar mask and temperature (vLLM's default),
so the values compare directly with `log_softmax` of a transformers forward pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from workers.engine.sequence import TokenLogprob


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: Sequence[int | None]) -> list[TokenLogprob | None]:
    """Per row of `logits` ([S, V], raw): the logprob of `token_ids[i]` and its `num_top[i]`
    most likely alternatives, or None where `num_top[i]` is None (the row asked for none)."""
    idx = [i for i, k in enumerate(num_top) if k is not None]
    out: list[TokenLogprob | None] = [None] * len(num_top)
    if not idx:
        return out
    device = logits.device
    index = torch.tensor(idx, dtype=torch.long, device=device)
    logprobs = logits[index].float().log_softmax(dim=-1)
    chosen = torch.tensor([token_ids[i] for i in idx], dtype=torch.long, device=device)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1).tolist()
    max_k = max(num_top[i] for i in idx)
    top_lp, top_ids = logprobs.topk(max_k, dim=-1) if max_k else (logprobs[:, :0], logprobs[:, :0].long())
    top_lp, top_ids = top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(idx):
        k = num_top[i]
        out[i] = TokenLogprob(int(token_ids[i]), chosen_lp[j], tuple(zip(top_ids[j][:k], top_lp[j][:k], strict=True)))
    return out
