"""The attention arithmetic over the paged cache, for the shapes `attention_plan` chooses.

Layer tensors are `[2, num_blocks, block_size, num_kv_heads, head_dim]`; `query` is the
step's packed `[num_tokens, num_heads, head_dim]`. Query head h reads KV head
`h // (num_heads // num_kv_heads)`, as transformers' `repeat_kv` does.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from workers.engine.attention_plan import PaddedGroup, SparseDecode

# torch notes once per process that its CSR tensors are in beta; the one CSR call here
# (`sampled_addmm`) is held against dense attention by tests/test_paged_attention.py.
warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta state")


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


def attend_sparse(query: torch.Tensor, cache: torch.Tensor, decode: SparseDecode, scaling: float) -> torch.Tensor:
    """`[B, num_heads, head_dim]` for `decode`'s sequences, their KV read where it lies: the
    scores of each sequence's own context only (a sampled matrix product), a softmax per
    row (through a `[rows, W]` grid, empty places at -inf), and each row's sum of
    its values weighted by the probabilities (`embedding_bag`, 2-3x a CSR product's speed
    on CPU)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    keys, values = cache[0].reshape(-1, head_dim), cache[1].reshape(-1, head_dim)  # [num_slots * kv_heads, dim], views
    pattern = decode.pattern(num_heads, cache.shape[3], keys.dtype)
    size = (pattern.crow.numel() - 1, keys.shape[0])
    q = (query[decode.tokens].to(keys.dtype) * scaling).reshape(size[0], head_dim)
    csr = torch.sparse_csr_tensor(pattern.crow, pattern.col, pattern.zeros, size, check_invariants=False)
    scores = torch.sparse.sampled_addmm(csr, q, keys.t(), beta=0.0).values()
    grid = torch.full((size[0] * decode.grid_width,), float("-inf"), dtype=torch.float32, device=query.device)
    grid.index_copy_(0, pattern.grid_index, scores.float())
    probs = grid.view(size[0], decode.grid_width).softmax(-1).view(-1).index_select(0, pattern.grid_index)
    out = F.embedding_bag(pattern.col, values, pattern.crow, mode="sum", per_sample_weights=probs.to(values.dtype),
                          include_last_offset=True)  # [B * num_heads, dim]
    return out.to(query.dtype).view(-1, num_heads, head_dim)
