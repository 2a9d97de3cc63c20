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

import array
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
    any (a new tensor when some row has; the input is never modified).

    Only the (row, token) cells a row has seen are touched, addressed as keys
    `row * vocab_size + token` (output tokens counted by `torch.unique`), so the cost
    follows the number of tokens, not rows x vocabulary."""
    idx = [i for i, row in enumerate(rows) if has_penalties(row)]
    if not idx:
        return logits
    chosen = [rows[i] for i in idx]
    output_keys = token_keys([r.output_token_ids for r in chosen], idx, logits)
    logits = logits.clone()
    flat = logits.view(-1)
    if any(r.params.repetition_penalty != 1.0 for r in chosen):
        prompt_keys = token_keys([r.prompt_token_ids for r in chosen], idx, logits)
        # A token seen twice is written twice with the same value: no need to deduplicate.
        seen = torch.cat([prompt_keys, output_keys])
        penalty = _per_row(rows, logits, lambda p: p.repetition_penalty)[seen // logits.shape[1]]
        flat[seen] = repetition_penalty(flat[seen], penalty)
    if any(r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0 for r in chosen):
        keys, counts = torch.unique(output_keys, return_counts=True)
        row_of = keys // logits.shape[1]
        frequency = _per_row(rows, logits, lambda p: p.frequency_penalty)[row_of]
        presence = _per_row(rows, logits, lambda p: p.presence_penalty)[row_of]
        flat[keys] -= frequency * counts + presence
    return logits


def repetition_penalty(logits: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """HF's rule for seen tokens: positive logits divided by the penalty, others multiplied."""
    return torch.where(logits > 0, logits / penalty, logits * penalty)


def token_keys(token_ids: Sequence[Sequence[int]], row_idx: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """`row_idx[j] * vocab_size + t` for every token `t` of `token_ids[j]` inside the vocabulary."""
    vocab_size = logits.shape[1]
    tokens = torch.cat([_long_tensor(ids) for ids in token_ids])
    row_of = torch.repeat_interleave(torch.tensor(row_idx, dtype=torch.long),
                                     torch.tensor([len(ids) for ids in token_ids], dtype=torch.long))
    keys = (row_of * vocab_size + tokens)[tokens < vocab_size]
    return keys.to(logits.device)


def _long_tensor(ids: Sequence[int]) -> torch.Tensor:
    # Through array.array: ~10x faster than torch.tensor on a list of Python ints.
    return torch.frombuffer(array.array("q", ids), dtype=torch.long) if len(ids) else torch.empty(0, dtype=torch.long)


def _per_row(rows: Sequence[SamplingRow], like: torch.Tensor, value) -> torch.Tensor:
    return torch.tensor([value(r.params) for r in rows], dtype=like.dtype, device=like.device)


def _tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)
