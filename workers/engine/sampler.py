"""Turns one step's logits into next tokens, one row per sequence.

Randomness is a pure function of `(seed, output_index)`: each random row draws its noise
from a CPU generator seeded by a fixed hash of the two, and picks its token by an
exponential race (`argmax(p / E)`, `E ~ Exp(1)`, the Gumbel-max trick in another form).
So the token a request samples at position `i` does not depend on which batch it sat in,
on which worker sampled it, or on how many tokens that worker sampled before: a request
whose first token comes from a prefill worker and the rest from a decode worker produces
exactly what one local run produces, and the same seed reproduces.

The noise is drawn on the CPU and moved to the logits' device, so CPU and CUDA workers
agree too (for a given torch version).
"""

from __future__ import annotations

import hashlib
import secrets
import struct
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from workers.engine.grammar import mask_disallowed
from workers.engine.logprobs import token_logprobs
from workers.engine.penalties import apply_logit_bias, apply_penalties
from workers.engine.sampling_params import SamplingParams
from workers.engine.sequence import TokenLogprob


@dataclass(frozen=True)
class SamplingRow:
    """What the sampler needs to know about one sequence this step."""

    params: SamplingParams
    seed: int  # the request's seed (`request_seed`), fixed for its whole life
    output_index: int  # index of the token being sampled among the generated ones
    eos_token_ids: frozenset[int]
    # The sequence's tokens so far, read by the penalties (the engine's own lists: rows
    # live for one sampler call, before the sampled token is appended).
    prompt_token_ids: Seq[int] = ()
    output_token_ids: Seq[int] = ()
    # With a grammar (structured outputs): bool[vocab], the tokens it allows next.
    allowed: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    """One step's tokens, and per row its `TokenLogprob` when the request asked for logprobs."""

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def request_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a fresh random one that the engine
    keeps with the request (and hands to the decode worker along with the KV)."""
    return params.seed if params.seed is not None else secrets.randbits(63)


def noise_seed(seed: int, output_index: int) -> int:
    """A fixed 63-bit hash of (seed, position); stable across processes and machines."""
    blob = struct.pack("<qq", seed & 0x7FFF_FFFF_FFFF_FFFF, output_index)
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little") >> 1


def exponential_noise(seed: int, output_index: int, vocab_size: int) -> torch.Tensor:
    """`Exp(1)` noise over the vocabulary for one position of one request (CPU, fp32)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(noise_seed(seed, output_index))
    return torch.empty(vocab_size, dtype=torch.float32).exponential_(generator=gen)


class Sampler:
    """`Sampler().sample(logits[S, V], rows) -> SamplerOutput`; stateless, so any instance
    on any worker gives the same answer for the same rows. Calling it gives the token ids."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        return self.sample(logits, rows).token_ids

    def sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        """raw logits -> (logprobs, from raw) -> logit bias -> penalties -> min_tokens mask
        -> greedy argmax or temperature / top-k / top-p / exponential race."""
        assert logits.dim() == 2 and logits.shape[0] == len(rows), (logits.shape, len(rows))
        raw = logits.float()
        logits = apply_penalties(apply_logit_bias(raw, rows), rows)
        logits = mask_stop_tokens(logits, rows)
        logits = mask_disallowed(logits, rows)  # a grammar's (structured outputs)
        token_ids = self.choose(logits, rows)
        return SamplerOutput(token_ids, token_logprobs(raw, token_ids, [r.params.logprobs for r in rows]))

    def choose(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Greedy rows take the argmax, the others draw from their distribution."""
        greedy = [i for i, row in enumerate(rows) if row.params.greedy]
        if len(greedy) == len(rows):  # the common all-greedy batch: one argmax, no scatter
            return logits.argmax(dim=-1).tolist()
        token_ids = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        random = [i for i, row in enumerate(rows) if not row.params.greedy]
        if greedy:
            idx = torch.tensor(greedy, device=logits.device)
            token_ids[idx] = logits[idx].argmax(dim=-1)
        if random:
            idx = torch.tensor(random, device=logits.device)
            token_ids[idx] = sample_random(logits[idx], [rows[i] for i in random])
        return token_ids.tolist()


def mask_stop_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Under `min_tokens`, EOS and `stop_token_ids` cannot be sampled. (`ignore_eos` only
    keeps EOS from stopping the request, as in vLLM; it stays sampleable.)"""
    cells = [
        (i, t)
        for i, row in enumerate(rows)
        if row.output_index < row.params.min_tokens
        for t in row.eos_token_ids | set(row.params.stop_token_ids)
        if t < logits.shape[1]
    ]
    if not cells:
        return logits
    logits = logits.clone()
    logits[[i for i, _ in cells], [t for _, t in cells]] = float("-inf")
    return logits


def sample_random(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, then top-k and top-p on the scaled logits, then the exponential race."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], device=device)
    logits = logits / temperature.unsqueeze(1)
    logits = apply_top_k_top_p(logits, [r.params.top_k for r in rows], [r.params.top_p for r in rows])
    probs = logits.softmax(dim=-1)
    noise = torch.stack([exponential_noise(r.seed, r.output_index, logits.shape[1]) for r in rows])
    return (probs / noise.to(device)).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set to -inf every logit outside each row's top-k and outside the smallest set of
    most likely tokens whose probability reaches top-p. Rows with neither are untouched."""
    vocab_size = logits.shape[1]
    k = [kk if 0 < kk < vocab_size else vocab_size for kk in top_k]
    if all(kk == vocab_size for kk in k) and all(p >= 1.0 for p in top_p):
        return logits
    # Sorting a large vocabulary dominates the cost; when every row has a top-k, only the
    # largest k candidates need sorting (topk returns them in order).
    sorted_logits, order = (logits.topk(max(k), dim=-1) if max(k) < vocab_size
                            else logits.sort(dim=-1, descending=True))
    kept = restrict_sorted(sorted_logits, k, top_p)
    return torch.full_like(logits, float("-inf")).scatter(1, order, kept)


def restrict_sorted(sorted_logits: torch.Tensor, k: list[int], top_p: list[float]) -> torch.Tensor:
    """Top-k then top-p on logits sorted in descending order, per row."""
    device = sorted_logits.device
    ranks = torch.arange(sorted_logits.shape[1], device=device).unsqueeze(0)
    drop = ranks >= torch.tensor(k, device=device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    probs = sorted_logits.softmax(dim=-1)
    # Probability mass strictly before each token: a token is kept while the mass before
    # it is still short of top_p, so the most likely token is always kept.
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p == 1 must keep everything even where the cumulative sum rounds up to 1.
    limit = torch.tensor([p if p < 1.0 else float("inf") for p in top_p], device=device)
    drop |= mass_before >= limit.unsqueeze(1)
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, float("-inf"))
