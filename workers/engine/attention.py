"""Paged attention behind transformers' attention interface.

The model code stays the real transformers Llama / Qwen2 / Mistral definition: we
register `paged_attention_forward` under `ATTENTION_NAME` and set
`config._attn_implementation` to it. Because the name is unknown to transformers' mask
interface, the model builds no 4-D mask. Each step passes one `AttentionMetadata` to
`model(...)` as the `attn_metadata` keyword; transformers forwards it to every attention
call, so there is no module-global state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface

from workers.engine.kv_cache import KVCache
from workers.engine.kv_types import KVSink

ATTENTION_NAME = "pdcluster_paged"


@dataclass
class KVExport:
    """Hand `block_ids` of every layer to `sink` as soon as that layer is written."""

    sink: KVSink
    block_ids: list[int]


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step of a packed batch (batch dim 1).

    Sequence i owns packed tokens `query_start_locs[i] : query_start_locs[i] + query_lens[i]`;
    they are its tokens `context_lens[i] - query_lens[i] : context_lens[i]`, and it attends
    over its first `context_lens[i]` tokens, stored in `block_tables[i]`.
    """

    kv_cache: KVCache
    backend: AttentionBackend
    slot_mapping: torch.Tensor  # [num_tokens] cache slot (block_id * block_size + offset) per new token
    query_start_locs: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]]
    exports: list[KVExport] = field(default_factory=list)
    backend_state: Any = None  # whatever `backend.prepare` precomputed for all layers

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass
class StaticDecode:
    """A captured decode step's attention inputs: tensors whose shapes never change and whose
    contents are refilled before each replay. Row i is one query token; it writes the K/V of
    row `write_rows[i]` at `slot_mapping[i]` (padding rows repeat a real row's K/V into that
    row's slot, so they change nothing) and attends the keys of `block_table[i]` where `mask[i]`."""

    slot_mapping: torch.Tensor  # [B]
    write_rows: torch.Tensor  # [B]
    block_table: torch.Tensor  # [B, W]
    mask: torch.Tensor  # [B, 1, 1, W * block_size], bool


class AttentionBackend(ABC):
    """How one layer's attention reads and writes the paged cache.

    Contract for `forward`, called once per layer per step:
    - `query` is `[num_tokens, num_heads, head_dim]`, `key`/`value` are
      `[num_tokens, num_kv_heads, head_dim]` for the packed new tokens, RoPE applied.
    - It must first write `key`/`value` into `meta.kv_cache` layer `layer_idx` at
      `meta.slot_mapping`, then attend each sequence's queries over its whole cached
      context (earlier steps' tokens and this step's), causally within the new tokens.
    - It returns `[num_tokens, num_heads, head_dim]` in packed order.
    `prepare` runs once per step before the first layer and may stash reusable tensors
    (masks, padded block tables) in `meta.backend_state`.
    `static_decode_state` serves a decode step captured in a CUDA graph (cuda_graphs.py):
    `prepare` is not called, and `forward` must read only the given static tensors.
    """

    def prepare(self, meta: AttentionMetadata) -> None:  # noqa: B027 - an optional hook
        """Precompute per-step state shared by all layers (optional)."""

    def static_decode_state(self, static: StaticDecode) -> Any:
        """The `backend_state` of a captured decode step over `static` (see `StaticDecode`);
        raises NotImplementedError where this backend cannot be captured."""
        raise NotImplementedError(f"{type(self).__name__} has no capturable decode step")

    @abstractmethod
    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata, scaling: float) -> torch.Tensor: ...


def write_kv(meta: AttentionMetadata, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> None:
    slots = meta.kv_cache.slots_view(layer_idx)
    slots[0].index_copy_(0, meta.slot_mapping, key.to(slots.dtype))
    slots[1].index_copy_(0, meta.slot_mapping, value.to(slots.dtype))


def export_layer(kv_cache: KVCache, layer_idx: int, export: KVExport) -> None:
    """Hand one layer of a request's blocks to its sink, with the payload checksum made
    during the copy when the sink wants one and the cache is in host memory, copied into
    the buffer the sink lends for it, if it lends one."""
    on_cpu = kv_cache.layers[layer_idx].device.type == "cpu"
    digest = export.sink.new_digest() if on_cpu else None
    nbytes = kv_cache.layout.layer_nbytes(len(export.block_ids))
    out = export.sink.export_buffer(nbytes) if on_cpu else None
    kv = kv_cache.read_blocks(layer_idx, export.block_ids, digest, out)
    export.sink.on_layer(layer_idx, kv, None if digest is None else digest.intdigest())


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None, scaling: float,
                            dropout: float = 0.0, attn_metadata: AttentionMetadata | None = None,
                            **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention signature: `query` `[1, heads, tokens, head_dim]` in, `[1, tokens, heads, head_dim]` out."""
    if attn_metadata is None:
        raise RuntimeError(f"{ATTENTION_NAME} attention needs attn_metadata=AttentionMetadata(...)")
    meta, layer_idx = attn_metadata, module.layer_idx
    out = meta.backend.forward(layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                               value[0].transpose(0, 1), meta, scaling)
    for export in meta.exports:  # this layer is in the cache now: let the transport stream it
        export_layer(meta.kv_cache, layer_idx, export)
    return out.unsqueeze(0), None


def register_paged_attention() -> str:
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    return ATTENTION_NAME
