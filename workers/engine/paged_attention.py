"""The attention arithmetic over the paged cache, for the shapes `attention_plan` chooses.

Layer tensors are `[2, num_blocks, block_size, num_kv_heads, head_dim]`; `query` is the
step's packed `[num_tokens, num_heads, head_dim]`. Query head h reads KV head
`h // (num_heads // num_kv_heads)`, as transformers' `repeat_kv` does.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from workers.engine.attention_plan import InPlaceDecode, PaddedGroup


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """`cache[:, block_ids]` (`[2, *block_ids.shape, block_size, kv_heads, head_dim]`) as one
    `index_select` of whole blocks: each block is one contiguous row, so the copy runs at
    memcpy speed (advanced indexing walks it element by element, ~25% slower on CPU)."""
    rows = cache.flatten(2)  # [2, num_blocks, block_elems], a view
    picked = torch.index_select(rows, 1, block_ids.reshape(-1))
    return picked.view(2, *block_ids.shape, *cache.shape[2:])


def attend_padded(query: torch.Tensor, cache: torch.Tensor, group: PaddedGroup, scaling: float,
                  key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> torch.Tensor:
    """`[num_real, num_heads, head_dim]`: the group's real query rows, in `group.tokens` order.

    One SDPA call; the group's blocks are gathered (padded to its longest context), which
    `attention_plan` keeps to short contexts and prompt chunks, where the math dominates.
    A group of chunks from position 0 (`mask` None) attends the step's own `key`/`value`
    rows (what was just written to the cache, same values) with SDPA's causal rule."""
    q = _rows(query, group).transpose(1, 2)  # [S, heads, L, dim]
    if group.mask is None:
        # through the cache's dtype, so the values are exactly what a gather would read
        k, v = (_rows(rows, group).to(cache.dtype).to(q.dtype).transpose(1, 2) for rows in (key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=True)
    else:
        kv = gather_blocks(cache, group.block_table).flatten(2, 3).transpose(2, 3)  # [2, S, kv_heads, C, dim]
        out = F.scaled_dot_product_attention(q, kv[0].to(q.dtype), kv[1].to(q.dtype), attn_mask=group.mask,
                                             scale=scaling, enable_gqa=True)
    out = out.transpose(1, 2).flatten(0, 1)
    return out if group.span is not None else out[group.rows]


def _rows(packed: torch.Tensor, group: PaddedGroup) -> torch.Tensor:
    """`[S, L, ...]`: the group's query rows of a packed `[num_tokens, ...]` tensor (a view
    for one sequence's span)."""
    if group.span is not None:
        return packed[group.span[0]:group.span[1]].unsqueeze(0)
    return packed[group.query_index]


def attend_in_place(query: torch.Tensor, cache: torch.Tensor, decode: InPlaceDecode, scaling: float) -> torch.Tensor:
    """`[B, num_heads, head_dim]` for `decode`'s sequences, reading long runs where they lie."""
    num_kv_heads = cache.shape[3]
    q = (query[decode.tokens] * scaling).unflatten(1, (num_kv_heads, -1))  # [B, kv_heads, group, dim]
    slots = cache.flatten(1, 2)  # [2, num_slots, kv_heads, dim], a view
    tail = gather_blocks(cache, decode.gather_block_ids).flatten(1, 2) if decode.gather_block_ids.numel() else None
    outs = []
    with _one_thread() if cache.device.type == "cpu" else contextlib.nullcontext():
        for i, seq in enumerate(decode.seqs):
            pieces = [slots[:, start:start + length] for start, length in seq.runs]
            if seq.gathered[1]:
                pieces.append(tail[:, seq.gathered[0]:seq.gathered[0] + seq.gathered[1]])
            outs.append(attend_pieces(q[i], pieces))
    return torch.stack(outs).flatten(1, 2)


@contextlib.contextmanager
def _one_thread():
    """Run a loop of small ops on the calling thread alone: each op of torch's intra-op
    pool ends at a barrier, and when another process holds the other core the barrier
    waits out its time slice, per op. On a loaded 2-core machine (2 torch threads) a step at
    batch 32, context 512 took 1.3 s this way and 11.6 s with the pool; on a quiet one the
    pool is faster only at long contexts (batch 32, context 2,048: 89 ms vs 125 ms; the
    padded gather took 270 ms). Replicas run one torch thread, where this changes nothing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def attend_pieces(q: torch.Tensor, pieces: list[torch.Tensor]) -> torch.Tensor:
    """One query token per head, `q` `[kv_heads, group, dim]` (already scaled), over keys
    split into `pieces` `[2, n, kv_heads, dim]` (strided views are fine): one softmax
    over all of them, so the split changes nothing but where the keys are read from."""
    scores = [torch.matmul(q, piece[0].to(q.dtype).permute(1, 2, 0)) for piece in pieces]  # [kv_heads, group, n]
    probs = torch.softmax(torch.cat(scores, -1).float() if len(scores) > 1 else scores[0].float(), -1).to(q.dtype)
    out, start = None, 0
    for piece in pieces:
        length = piece.shape[1]
        part = torch.matmul(probs[..., start:start + length], piece[1].to(q.dtype).transpose(0, 1))
        out = part if out is None else out + part
        start += length
    return out
