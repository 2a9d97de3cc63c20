"""The torch SDPA attention backend (CPU and CUDA).

Decoding sequences (one new token each) are attended in one batched SDPA call over
their block tables padded to the longest context; prefill chunks are attended one
sequence at a time with a causal mask offset by the tokens already cached.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engine.attention import AttentionBackend, AttentionMetadata, write_kv


@dataclass
class _DecodeBatch:
    seq_indices: list[int]
    token_index: torch.Tensor  # [B] packed position of each decode query
    block_table: torch.Tensor  # [B, max_blocks], padded with block 0
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size], True where attended


@dataclass
class _PrefillSeq:
    start: int
    length: int
    block_ids: torch.Tensor
    context_len: int
    mask: torch.Tensor | None  # None: plain causal (no cached prefix)


@dataclass
class _SdpaState:
    decode: _DecodeBatch | None
    prefills: list[_PrefillSeq]


class SdpaBackend(AttentionBackend):
    def prepare(self, meta: AttentionMetadata) -> None:
        device = meta.slot_mapping.device
        decode_ids = [i for i in range(meta.num_seqs) if meta.query_lens[i] == 1]
        prefills = [self._prefill_seq(meta, i, device) for i in range(meta.num_seqs) if meta.query_lens[i] != 1]
        decode = self._decode_batch(meta, decode_ids, device) if decode_ids else None
        meta.backend_state = _SdpaState(decode, prefills)

    def _prefill_seq(self, meta: AttentionMetadata, i: int, device: torch.device) -> _PrefillSeq:
        length, context_len = meta.query_lens[i], meta.context_lens[i]
        num_blocks = meta.kv_cache.layout.num_blocks(context_len)
        block_ids = torch.tensor(meta.block_tables[i][:num_blocks], dtype=torch.long, device=device)
        mask = None
        if context_len != length:  # query j sits at position context_len - length + j
            q_pos = torch.arange(context_len - length, context_len, device=device)[:, None]
            mask = torch.arange(context_len, device=device)[None, :] <= q_pos
        return _PrefillSeq(meta.query_start_locs[i], length, block_ids, context_len, mask)

    def _decode_batch(self, meta: AttentionMetadata, seq_ids: list[int], device: torch.device) -> _DecodeBatch:
        block_size = meta.kv_cache.layout.block_size
        context_lens = [meta.context_lens[i] for i in seq_ids]
        max_blocks = meta.kv_cache.layout.num_blocks(max(context_lens))
        rows = [meta.block_tables[i][:max_blocks] for i in seq_ids]
        table = torch.tensor([r + [0] * (max_blocks - len(r)) for r in rows], dtype=torch.long, device=device)
        lens = torch.tensor(context_lens, device=device)
        mask = torch.arange(max_blocks * block_size, device=device)[None, :] < lens[:, None]
        token_index = torch.tensor([meta.query_start_locs[i] for i in seq_ids], device=device)
        return _DecodeBatch(seq_ids, token_index, table, mask[:, None, None, :])

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata, scaling: float) -> torch.Tensor:
        write_kv(meta, layer_idx, key, value)
        state: _SdpaState = meta.backend_state
        cache = meta.kv_cache.layers[layer_idx]
        out = torch.empty_like(query)
        for p in state.prefills:
            out[p.start:p.start + p.length] = self._attend_prefill(query, cache, p, scaling)
        if state.decode is not None:
            out[state.decode.token_index] = self._attend_decode(query, cache, state.decode, scaling)
        return out

    @staticmethod
    def _attend_prefill(query: torch.Tensor, cache: torch.Tensor, p: _PrefillSeq, scaling: float) -> torch.Tensor:
        kv = cache[:, p.block_ids].flatten(1, 2)[:, :p.context_len]  # [2, ctx, kv_heads, dim]
        q = query[p.start:p.start + p.length].transpose(0, 1)  # [heads, len, dim]
        k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=p.mask,
                                             is_causal=p.mask is None, scale=scaling, enable_gqa=True)
        return out.transpose(0, 1)

    @staticmethod
    def _attend_decode(query: torch.Tensor, cache: torch.Tensor, d: _DecodeBatch, scaling: float) -> torch.Tensor:
        kv = cache[:, d.block_table].flatten(2, 3)  # [2, B, max_ctx, kv_heads, dim]
        q = query[d.token_index][:, :, None, :]  # [B, heads, 1, dim]
        k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=d.mask,
                                             scale=scaling, enable_gqa=True)
        return out[:, :, 0, :]
