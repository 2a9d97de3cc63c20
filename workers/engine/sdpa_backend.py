"""The torch attention backend (CPU and CUDA): reads the paged cache through plain torch
ops, device-agnostic.

`prepare` plans the step (attention_plan.py): decodes read their KV in place (a sampled
matrix product and `embedding_bag`), prompt chunks are attended a padded group per SDPA
call. A captured decode step (cuda_graphs.py) runs a fixed plan instead: one padded
group over its static buffers, so the graph reads the block table's width of every row's
KV (the price of a capturable shape), and `write_rows`, which points padding rows at a
real row's K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.engine.attention import AttentionBackend, AttentionMetadata, StaticDecode, write_kv
from workers.engine.attention_plan import (
    AttentionPlan,
    PaddedGroup,
    SeqWork,
    plan_step,
)
from workers.engine.paged_attention import attend_padded, attend_sparse

# Cache dtypes the in-place path takes: torch's CPU `sampled_addmm` refuses bfloat16 and float16.
IN_PLACE_DTYPES = (torch.float32, torch.float64)


@dataclass
class SdpaState:
    plan: AttentionPlan
    # [num_tokens] which row's K/V each row writes: None writes every row's own. Padding
    # rows of a captured step repeat row 0's K/V into row 0's slot, so they change nothing.
    write_rows: torch.Tensor | None = None


class SdpaBackend(AttentionBackend):
    def __init__(self, in_place: bool | None = None) -> None:
        """`in_place`: decodes read their KV in place (None: where the cache is in host
        memory; a GPU's decode steps run captured at fixed shapes, padded). A cache in a
        dtype the sparse products lack (bfloat16, float16) is attended padded."""
        self.in_place = in_place

    def prepare(self, meta: AttentionMetadata) -> None:
        works = [SeqWork(meta.query_start_locs[i], meta.query_lens[i], meta.context_lens[i], meta.block_tables[i])
                 for i in range(meta.num_seqs)]
        device = meta.slot_mapping.device
        in_place = self.in_place if self.in_place is not None else device.type == "cpu"
        in_place = in_place and meta.kv_cache.layers[0].dtype in IN_PLACE_DTYPES
        meta.backend_state = SdpaState(plan_step(works, meta.kv_cache.layout.block_size, device, in_place))

    def static_decode_state(self, static: StaticDecode) -> SdpaState:
        rows = torch.arange(static.block_table.shape[0], device=static.block_table.device)
        group = PaddedGroup(rows[:, None], static.block_table, static.mask, rows, rows)
        return SdpaState(AttentionPlan([group], None), static.write_rows)

    def forward(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata, scaling: float) -> torch.Tensor:
        state: SdpaState = meta.backend_state
        if state.write_rows is not None:
            key, value = key[state.write_rows], value[state.write_rows]
        write_kv(meta, layer_idx, key, value)
        cache = meta.kv_cache.layers[layer_idx]
        groups = state.plan.groups
        if state.plan.in_place is None and len(groups) == 1 and groups[0].span == (0, query.shape[0]):
            return attend_padded(query, cache, groups[0], scaling, key, value)  # one sequence: no scatter
        out = torch.empty_like(query)
        for group in state.plan.groups:
            out[group.tokens] = attend_padded(query, cache, group, scaling, key, value)
        if state.plan.in_place is not None:
            out[state.plan.in_place.tokens] = attend_sparse(query, cache, state.plan.in_place, scaling)
        return out
