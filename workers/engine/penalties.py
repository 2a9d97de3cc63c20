"""Logit bias and the repetition penalties, batched over the rows of one step.

All of it is a function of the request's parameters and its prompt and output token ids,
so nothing here is state: a decode replica that imported a prompt's KV (it has the prompt
and the first token) applies exactly what the prefill replica would have.

Semantics (vLLM's, which are OpenAI's and HF's):
    logit[t] += bias[t]                                              logit_bias
    seen in prompt or output: logit[t] = logit[t] / p if > 0 else logit[t] * p
                                                                     repetition_penalty p
    logit[t] -= frequency_penalty * count[t] + presence_penalty * (count[t] > 0)
                                                                     over output tokens only
Token ids outside the logits' vocabulary are ignored (a tokenizer's vocabulary can be
smaller than the model's logits, never larger).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.engine.sampler import SamplingRow


def has_penalties(row: SamplingRow) -> bool:
    p = row.params
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`logits` with each row's `logit_bias` added (a new tensor; the input is untouched)."""
    cells = [(i, t, b) for i, row in enumerate(rows) for t, b in row.params.logit_bias if t < logits.shape[1]]
    if not cells:
        return logits
    rows_idx, token_ids, biases = zip(*cells, strict=True)
    index = (_tensor(rows_idx, logits.device), _tensor(token_ids, logits.device))
    return logits.index_put(index, torch.tensor(biases, dtype=logits.dtype, device=logits.device),
                            accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """`logits` with the repetition, frequency and presence penalties of the rows that have
    any (a new tensor when some row has; the input is never modified)."""
    idx = [i for i, row in enumerate(rows) if has_penalties(row)]
    if not idx:
        return logits
    chosen = [rows[i] for i in idx]
    device, vocab_size = logits.device, logits.shape[1]
    index = _tensor(idx, device)
    sub = logits[index]
    seen = token_counts([[*r.prompt_token_ids, *r.output_token_ids] for r in chosen], vocab_size, device) > 0
    sub = repetition_penalty(sub, seen, _column([r.params.repetition_penalty for r in chosen], sub))
    counts = token_counts([r.output_token_ids for r in chosen], vocab_size, device)
    sub = sub - _column([r.params.frequency_penalty for r in chosen], sub) * counts
    sub = sub - _column([r.params.presence_penalty for r in chosen], sub) * (counts > 0)
    return logits.index_copy(0, index, sub)


def repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's rule on the `seen` tokens: positive logits divided by the penalty, others multiplied."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def token_counts(token_ids: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """`[len(token_ids), vocab_size]` fp32: how often each token occurs in each row's ids."""
    counts = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)
    flat = [t for ids in token_ids for t in ids if t < vocab_size]
    if flat:
        row_idx = [i for i, ids in enumerate(token_ids) for t in ids if t < vocab_size]
        index = (_tensor(row_idx, device), _tensor(flat, device))
        counts.index_put_(index, torch.ones(len(flat), device=device), accumulate=True)
    return counts


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
