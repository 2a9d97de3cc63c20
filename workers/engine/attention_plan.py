"""How one step's sequences are attended, decided once per step before the first layer.

Two shapes of work, both exact (every query attends exactly its own context):

- In place (`InPlaceDecode`): a decoding sequence with a long context reads its KV where
  it lies. Its block table is cut into runs of consecutive blocks; a run of at least
  `MIN_RUN_BLOCKS` is a zero-copy slice of the cache, the short runs (blocks handed out
  one at a time while decoding) of every such sequence are gathered together in one copy.
  A busy engine's sequences hold their prompt in one long run, so the copy per step is
  the short tails, not batch x longest context.
- Padded (`PaddedGroup`): prompt chunks and short decodes are attended a group at a time
  in one SDPA call over their block tables padded to the group's longest, with a mask
  for the causal offset and the ragged lengths. Groups are cut so that padding wastes
  at most `MAX_PADDING_WASTE` of the group's real work. A group of prompts that start at
  position 0 (no cached prefix, first chunk) needs no mask: SDPA's own causal rule is
  theirs, and its kernel then skips the scores above the diagonal, half of a prompt's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MIN_RUN_BLOCKS = 4  # shorter runs are gathered: a matmul per 16 tokens costs more than the copy
# Shorter decodes are cheaper padded together in one call. With several torch threads the
# padded call uses them all while the in-place loop runs on one (paged_attention.py), which
# moves the break-even from ~128 to ~768 tokens (2 threads, small preset, batch 8 and 32).
IN_PLACE_MIN_CONTEXT = 128
IN_PLACE_MIN_CONTEXT_POOLED = 768
MAX_PADDING_WASTE = 0.5  # a group's padded area may exceed its real area by this fraction


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


@dataclass(frozen=True)
class InPlaceSeq:
    runs: tuple[tuple[int, int], ...]  # (first cache slot, num tokens) read in place
    gathered: tuple[int, int]  # (first token, num tokens) in the step's gathered tail


@dataclass
class InPlaceDecode:
    seqs: list[InPlaceSeq]
    tokens: torch.Tensor  # [B] packed token of each sequence's query
    gather_block_ids: torch.Tensor  # [num_short_blocks] blocks of the short runs, in sequence order


@dataclass
class AttentionPlan:
    groups: list[PaddedGroup]
    in_place: InPlaceDecode | None


def in_place_min_context(num_threads: int) -> int:
    return IN_PLACE_MIN_CONTEXT if num_threads == 1 else IN_PLACE_MIN_CONTEXT_POOLED


def plan_step(works: list[SeqWork], block_size: int, device: torch.device,
              min_context: int | None = IN_PLACE_MIN_CONTEXT) -> AttentionPlan:
    """Decodes with at least `min_context` tokens read in place; None pads every sequence
    into groups (where ~10 small ops per sequence and layer cost more than the copy, as
    kernel launches on a GPU do)."""
    reads_in_place = [min_context is not None and w.query_len == 1 and w.context_len >= min_context for w in works]
    direct = [w for w, yes in zip(works, reads_in_place, strict=True) if yes]
    padded = [w for w, yes in zip(works, reads_in_place, strict=True) if not yes]
    groups = [padded_group(g, block_size, device) for g in group_by_padding(padded)]
    return AttentionPlan(groups, in_place_decode(direct, block_size, device) if direct else None)


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
    table = [w.block_ids[:max_blocks] + [0] * (max_blocks - len(w.block_ids[:max_blocks])) for w in works]
    rows = [i * max_len + j for i, w in enumerate(works) for j in range(w.query_len)]
    tokens = [w.query_start + j for w in works for j in range(w.query_len)]
    as_long = dict(dtype=torch.long, device=device)
    from_start = all(w.context_len == w.query_len for w in works)
    span = (works[0].query_start, works[0].query_start + works[0].query_len) if len(works) == 1 else None
    return PaddedGroup(torch.tensor(query_index, **as_long), torch.tensor(table, **as_long),
                       None if from_start else causal_mask(works, max_len, max_blocks * block_size, device),
                       torch.tensor(rows, **as_long), torch.tensor(tokens, **as_long), span)


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


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """(first block, num blocks) of each run of consecutive ids, in order."""
    runs: list[tuple[int, int]] = []
    for block_id in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((block_id, 1))
    return runs


def in_place_decode(works: list[SeqWork], block_size: int, device: torch.device) -> InPlaceDecode:
    seqs, gather_ids = [], []
    for work in works:
        seq, short_ids = _in_place_seq(work, block_size, len(gather_ids) * block_size)
        seqs.append(seq)
        gather_ids += short_ids
    return InPlaceDecode(seqs, torch.tensor([w.query_start for w in works], dtype=torch.long, device=device),
                         torch.tensor(gather_ids, dtype=torch.long, device=device))


def _in_place_seq(work: SeqWork, block_size: int, gather_start: int) -> tuple[InPlaceSeq, list[int]]:
    """Long runs stay where they are; short ones join the gathered tail, in order, so a
    partly filled last block ends its sequence's gathered span when it is gathered."""
    num_blocks = -(-work.context_len // block_size)
    unfilled = num_blocks * block_size - work.context_len  # empty slots of the last block
    runs = block_runs(work.block_ids[:num_blocks])
    in_place, short_ids = [], []
    for i, (first, length) in enumerate(runs):
        if length >= MIN_RUN_BLOCKS:
            in_place.append((first * block_size, length * block_size - (unfilled if i == len(runs) - 1 else 0)))
        else:
            short_ids += range(first, first + length)
    last_gathered = runs[-1][1] < MIN_RUN_BLOCKS
    gathered = len(short_ids) * block_size - (unfilled if last_gathered else 0)
    return InPlaceSeq(tuple(in_place), (gather_start, gathered)), short_ids
