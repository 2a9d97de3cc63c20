"""Token mismatches between the engine and transformers, each classified at its first
differing token: a `near_tie` when float rounding may pick either token, else `real`.

Two verdicts, from two sources of truth:
- transformers' fp32 logits at that position: a near tie when both runners' tokens are
  within `NEAR_TIE_LOGIT_GAP` of the top logit;
- the engine's own logprobs there (`SamplingParams.logprobs`, from a rerun of the same
  workload, which schedules and so computes exactly as the timed run): a near tie when
  its top two are within `NEAR_TIE_LOGPROB_GAP` and transformers' token is one of them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workers.engine.sequence import TokenLogprob

# Two logits this close are a tie in fp32: batched and unbatched matmuls sum in different
# orders and differ by ~1e-6 relative, which can flip the argmax between them.
NEAR_TIE_LOGIT_GAP = 1e-4
NEAR_TIE_LOGPROB_GAP = 1e-3
MAX_MISMATCH_EXAMPLES = 10
NextLogits = Callable[[list[int]], torch.Tensor]  # token ids -> the next token's logits [vocab]


def mismatches(reference: list[list[int]], other: list[list[int]]) -> list[dict]:
    """Requests whose tokens differ, with the first position that differs."""
    out = []
    for i, (a, b) in enumerate(zip(reference, other, strict=True)):
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            out.append({"request": i, "first_diff_at": first, "len": [len(a), len(b)]})
    return out


def classify_divergence(logits: torch.Tensor, token_a: int, token_b: int,
                        tol: float = NEAR_TIE_LOGIT_GAP) -> dict:
    """Two runners chose `token_a` and `token_b` from `logits` [vocab]: a `near_tie` when
    both are within `tol` of the top logit (then they are its top two), else `real`.
    `logit_gap`: the top logit minus the lower of the two."""
    top = logits.max().item()
    gap = top - min(logits[token_a].item(), logits[token_b].item())
    return {"kind": "near_tie" if gap <= tol else "real", "logit_gap": gap}


def classify_mismatches(found: dict[str, list[dict]], reference: list[list[int]], others: dict[str, list[list[int]]],
                        prompts: list[list[int]], next_logits: NextLogits) -> dict:
    """Counts of `near_tie` and `real` mismatches over every runner, with the first
    `MAX_MISMATCH_EXAMPLES` of them. A length difference without a differing token is `real`."""
    counts = {"near_tie": 0, "real": 0}
    examples = []
    logits_cache: dict[tuple[int, int], torch.Tensor] = {}
    for runner, entries in found.items():
        for entry in entries:
            i, first = entry["request"], entry["first_diff_at"]
            ours, theirs = reference[i], others[runner][i]
            verdict: dict = {"kind": "real", "logit_gap": None}
            if first < min(len(ours), len(theirs)):
                if (i, first) not in logits_cache:  # runners often part at the same place
                    logits_cache[i, first] = next_logits(prompts[i] + ours[:first])
                verdict = classify_divergence(logits_cache[i, first], ours[first], theirs[first])
                verdict["tokens"] = [ours[first], theirs[first]]
            counts[verdict["kind"]] += 1
            if len(examples) < MAX_MISMATCH_EXAMPLES:
                examples.append({"runner": runner, **entry, **verdict})
    return {**counts, "examples": examples}


def hf_next_logits(model) -> NextLogits:
    @torch.inference_mode()
    def next_logits(token_ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([token_ids])).logits[0, -1].float()

    return next_logits


def classify_by_logprobs(found: dict[str, list[dict]], reference: list[list[int]],
                         others: dict[str, list[list[int]]], logprobs: list[list[TokenLogprob]],
                         tol: float = NEAR_TIE_LOGPROB_GAP) -> dict[str, int]:
    """Counts of `near_tie` and `real` mismatches by the engine's top-two logprobs at each
    first differing token (`logprobs[i][j]`: request i's token j, with at least two `top`)."""
    counts = {"near_tie": 0, "real": 0}
    for runner, entries in found.items():
        for entry in entries:
            i, first = entry["request"], entry["first_diff_at"]
            theirs = others[runner][i]
            near = first < min(len(reference[i]), len(theirs)) and is_logprob_tie(logprobs[i][first], theirs[first], tol)
            counts["near_tie" if near else "real"] += 1
    return counts


def is_logprob_tie(entry: TokenLogprob, other_token: int, tol: float = NEAR_TIE_LOGPROB_GAP) -> bool:
    """The engine's two most likely tokens are within `tol` and `other_token` is one of them."""
    if len(entry.top) < 2:
        return False
    (first_id, first_lp), (second_id, second_lp) = entry.top[:2]
    return first_lp - second_lp <= tol and other_token in (first_id, second_id)
