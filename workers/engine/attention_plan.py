"""How one step's sequences are attended, decided once per step before the first layer.

Two shapes of work, both exact (every query attends exactly its own context):

- In place (`SparseDecode`): every decoding sequence reads its KV where it lies. The
  step's decodes are one sparse pattern over the cache's rows (row `slot * kv_heads + h`
  of a layer's flat `[num_slots * kv_heads, head_dim]` keys or values): query head h of
  sequence i scores the rows of its context's slots. A sampled matrix product computes
  only those scores, a softmax runs per row, and `embedding_bag` sums each row's values
  weighted by the probabilities, so no KV is copied and the work is each sequence's own
  context, in a few calls for the whole batch whatever its size (paged_attention.py).
  Decodes that attend fewer than `IN_PLACE_MIN_TOKENS` in all go padded.
- Padded (`PaddedGroup`): prompt chunks (and, where the cache cannot be read in place,
  decodes) are attended a group at a time in one SDPA call over their block tables padded
  to the group's longest, with a mask for the causal offset and the ragged lengths. Groups
  are cut so that padding wastes at most `MAX_PADDING_WASTE` of the group's real work. A
  group of prompts that start at position 0 (no cached prefix, first chunk) needs no
  mask: SDPA's own causal rule is theirs, and its kernel then skips the scores above the
  diagonal, half of a prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MAX_PADDING_WASTE = 0.5  # a group's padded area may exceed its real area by this fraction
# Decodes attending fewer context tokens in all go padded: their copy is small, and the
# in-place calls cost ~0.5 ms more a step than one SDPA call (small, 1 and 2 threads: a lone
# decode at 512 tokens 11.7 vs 12.1 ms; at 8 x 128 and 1 x 2,048 tokens the two are even).
IN_PLACE_MIN_TOKENS = 1024


@dataclass(frozen=True)
class SeqWork:
    """One sequence's share of the step (see `AttentionMetadata`)."""

    query_start: int
    query_len: int
    context_len: int
    block_ids: list[int]  # at least the blocks holding `context_len` tokens

    @property
    def area(self) -> int:
        """Scores this sequence computes, plus its keys (the gather)."""
        return (self.query_len + 1) * self.context_len


@dataclass
class PaddedGroup:
    """Sequences attended in one SDPA call: `S` rows of up to `L` queries over `C` keys."""

    query_index: torch.Tensor  # [S, L] packed token of each query row (padding repeats a real one)
    block_table: torch.Tensor  # [S, C // block_size], padded with block 0
    # [S, 1, L, C], True where a query attends a key; None when every sequence's chunk starts
    # at position 0, so query j sees keys 0..j (SDPA's is_causal) and its keys are its own rows
    mask: torch.Tensor | None
    rows: torch.Tensor  # [num_real] flat index into the S*L rows of the real queries
    tokens: torch.Tensor  # [num_real] packed token each real row answers
    # one sequence: its packed tokens [first, end), read and answered as slices, not copies
    span: tuple[int, int] | None = None


@dataclass
class AttentionPlan:
    groups: list[PaddedGroup]
    in_place: SparseDecode | None


def plan_step(works: list[SeqWork], block_size: int, device: torch.device, in_place: bool = True) -> AttentionPlan:
    """Decodes read in place when `in_place` and they attend at least `IN_PLACE_MIN_TOKENS`
    in all; otherwise every sequence is padded into groups (a captured GPU step's fixed
    shapes, or a cache dtype the sparse products lack)."""
    decodes = [w for w in works if w.query_len == 1]
    in_place = in_place and sum(w.context_len for w in decodes) >= IN_PLACE_MIN_TOKENS
    direct = decodes if in_place else []
    padded = [w for w in works if not (in_place and w.query_len == 1)]
    groups = [padded_group(g, block_size, device) for g in group_by_padding(padded)]
    return AttentionPlan(groups, sparse_decode(direct, block_size, device) if direct else None)


# -- padded groups ----------------------------------------------------------------------------


def group_by_padding(works: list[SeqWork]) -> list[list[SeqWork]]:
    """Greedy groups of similar shape, longest context first, each within the waste bound."""
    groups: list[list[SeqWork]] = []
    for work in sorted(works, key=lambda w: (w.context_len, w.query_len), reverse=True):
        if groups and _padded_area(groups[-1] + [work]) <= (1 + MAX_PADDING_WASTE) * _real_area(groups[-1] + [work]):
            groups[-1].append(work)
        else:
            groups.append([work])
    return groups


def _padded_area(works: list[SeqWork]) -> int:
    return len(works) * (max(w.query_len for w in works) + 1) * max(w.context_len for w in works)


def _real_area(works: list[SeqWork]) -> int:
    return sum(w.area for w in works)


def padded_group(works: list[SeqWork], block_size: int, device: torch.device) -> PaddedGroup:
    max_len = max(w.query_len for w in works)
    max_blocks = -(-max(w.context_len for w in works) // block_size)
    query_index = [[w.query_start + min(j, w.query_len - 1) for j in range(max_len)] for w in works]
    table = padded_table(works, max_blocks)
    rows = [i * max_len + j for i, w in enumerate(works) for j in range(w.query_len)]
    tokens = [w.query_start + j for w in works for j in range(w.query_len)]
    as_long = dict(dtype=torch.long, device=device)
    from_start = all(w.context_len == w.query_len for w in works)
    span = (works[0].query_start, works[0].query_start + works[0].query_len) if len(works) == 1 else None
    return PaddedGroup(torch.tensor(query_index, **as_long), torch.tensor(table, **as_long),
                       None if from_start else causal_mask(works, max_len, max_blocks * block_size, device),
                       torch.tensor(rows, **as_long), torch.tensor(tokens, **as_long), span)


def padded_table(works: list[SeqWork], max_blocks: int) -> list[list[int]]:
    """Each sequence's first `max_blocks` block ids, padded with block 0."""
    return [ids + [0] * (max_blocks - len(ids)) for ids in (w.block_ids[:max_blocks] for w in works)]


def causal_mask(works: list[SeqWork], max_len: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """Query row j of a sequence sits at position `context_len - query_len + j` and sees every
    key at or before it; padding rows sit on the last real query, so no row is all-masked."""
    context = torch.tensor([w.context_len for w in works], device=device)[:, None]
    length = torch.tensor([w.query_len for w in works], device=device)[:, None]
    row = torch.minimum(torch.arange(max_len, device=device)[None, :], length - 1)
    query_pos = context - length + row  # [S, L]
    keys = torch.arange(num_keys, device=device)
    return (keys[None, None, :] <= query_pos[:, :, None])[:, None]


# -- in place -------------------------------------------------------------------------------


@dataclass
class SparsePattern:
    """The scores a step's decodes compute, for one head layout. Row `i * num_heads + h` is
    query head h of sequence i (the heads sharing a KV head are neighbours, so the rows
    they read stay in cache between them); its entries are the flat cache rows of that
    sequence's context for h's KV head, in context order."""

    crow: torch.Tensor  # [B * num_heads + 1] CSR row offsets
    col: torch.Tensor  # [nnz] flat cache row (slot * kv_heads + kv head) of each score
    grid_index: torch.Tensor  # [nnz] each score's place in a [B * num_heads, W] grid
    zeros: torch.Tensor  # [nnz] the pattern's values, for the sampled product to fill


@dataclass
class SparseDecode:
    """Decodes attended in place (see the module's docstring)."""

    tokens: torch.Tensor  # [B] packed token of each sequence's query
    slot_grid: torch.Tensor  # [B, W] each sequence's cache slots in context order, W a whole number of blocks
    context_lens: torch.Tensor  # [B]
    patterns: dict[tuple[int, int, torch.dtype], SparsePattern] = field(default_factory=dict)

    @property
    def grid_width(self) -> int:
        return self.slot_grid.shape[1]

    def pattern(self, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> SparsePattern:
        """Built on the step's first layer and kept for the others."""
        key = (num_heads, num_kv_heads, dtype)
        if key not in self.patterns:
            self.patterns[key] = sparse_pattern(self, num_heads, num_kv_heads, dtype)
        return self.patterns[key]


def sparse_decode(works: list[SeqWork], block_size: int, device: torch.device) -> SparseDecode:
    max_blocks = -(-max(w.context_len for w in works) // block_size)
    table = torch.tensor(padded_table(works, max_blocks), dtype=torch.long, device=device)
    slot_grid = (table[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
    as_long = dict(dtype=torch.long, device=device)
    return SparseDecode(torch.tensor([w.query_start for w in works], **as_long), slot_grid,
                        torch.tensor([w.context_len for w in works], **as_long))


def sparse_pattern(decode: SparseDecode, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> SparsePattern:
    """Rows `[B, num_heads]` over the `[B, W]` slot grid: the places inside each context,
    in row-major order, are the pattern's entries and their places in the score grid."""
    device, width = decode.slot_grid.device, decode.grid_width
    in_context = torch.arange(width, device=device)[None, :] < decode.context_lens[:, None]  # [B, W]
    grid_index = in_context[:, None, :].expand(-1, num_heads, -1).reshape(-1).nonzero().squeeze(1)
    kv_head = torch.arange(num_heads, device=device) // (num_heads // num_kv_heads)
    col = (decode.slot_grid[:, None, :] * num_kv_heads + kv_head[None, :, None]).reshape(-1)[grid_index]
    crow = torch.zeros(decode.context_lens.numel() * num_heads + 1, dtype=torch.long, device=device)
    torch.cumsum(decode.context_lens.repeat_interleave(num_heads), 0, out=crow[1:])
    return SparsePattern(crow, col, grid_index, torch.zeros(col.numel(), dtype=dtype, device=device))
