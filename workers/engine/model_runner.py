"""Runs one scheduled step through the real transformers model on the paged cache.

All scheduled tokens are packed into one row (batch dim 1) with explicit `position_ids`;
`use_cache=False` keeps transformers' DynamicCache out, the paged attention function
reads and writes our own cache, and only the last token of each sequence that samples
this step goes through `lm_head` (plus, for a request that asks for prompt logprobs, the
prompt positions it computes this step).
"""

from __future__ import annotations

import itertools

import torch
from transformers import AutoModelForCausalLM

from workers.engine.attention import (
    AttentionBackend,
    AttentionMetadata,
    KVExport,
    register_paged_attention,
)
from workers.engine.kv_cache import KVCache, auto_num_blocks, layout_from_config
from workers.engine.prompt_logprobs import prompt_positions
from workers.engine.scheduler import ScheduledSeq
from workers.engine.sdpa_backend import SdpaBackend


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    resolved = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return resolved


class ModelRunner:
    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype, block_size: int,
                 num_kv_blocks: int | None, gpu_memory_fraction: float, cpu_kv_bytes: int,
                 backend: AttentionBackend | None = None) -> None:
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.model.config._attn_implementation = register_paged_attention()
        self.config = self.model.config
        self.layout = layout_from_config(self.config, block_size, dtype)
        num_blocks = num_kv_blocks or auto_num_blocks(self.layout, device, gpu_memory_fraction, cpu_kv_bytes)
        self.kv_cache = KVCache(self.layout, num_blocks, device)
        self.backend = backend or SdpaBackend()

    @property
    def max_model_len(self) -> int:
        """Context the engine serves exactly: capped at a sliding window, which the SDPA
        backend does not apply (every token attends to its whole context)."""
        window = getattr(self.config, "sliding_window", None)
        if window and getattr(self.config, "use_sliding_window", True):
            return min(window, self.config.max_position_embeddings)
        return self.config.max_position_embeddings

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], exports: list[KVExport]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Compute `batch`; returns float32 logits `[num_sampling_seqs, vocab]` in batch order,
        and per batch entry the logits of its `prompt_positions` (most often none)."""
        meta = self._metadata(batch, exports)
        self.backend.prepare(meta)
        positions = torch.cat([torch.arange(s.start, s.end) for s in batch]).to(self.device)
        input_ids = torch.tensor([t for s in batch for t in s.seq.token_ids[s.start:s.end]],
                                 dtype=torch.long, device=self.device)
        sample_idx = self._sample_positions(batch)
        prompt_idx = self._prompt_positions(batch)
        keep = torch.tensor(sample_idx + [i for idx in prompt_idx for i in idx], dtype=torch.long, device=self.device)
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                         logits_to_keep=keep, attn_metadata=meta)
        logits = out.logits[0].float()
        prompt_logits = logits[len(sample_idx):].split([len(idx) for idx in prompt_idx])
        return logits[:len(sample_idx)], list(prompt_logits)

    def _metadata(self, batch: list[ScheduledSeq], exports: list[KVExport]) -> AttentionMetadata:
        query_lens = [s.num_new_tokens for s in batch]
        starts = [0, *itertools.accumulate(query_lens)][:-1]
        return AttentionMetadata(
            kv_cache=self.kv_cache, backend=self.backend,
            slot_mapping=self._slot_mapping(batch),
            query_start_locs=starts, query_lens=query_lens,
            context_lens=[s.end for s in batch],
            block_tables=[s.seq.block_ids for s in batch],
            exports=exports,
        )

    def _slot_mapping(self, batch: list[ScheduledSeq]) -> torch.Tensor:
        block_size = self.layout.block_size
        slots = [s.seq.block_ids[pos // block_size] * block_size + pos % block_size
                 for s in batch for pos in range(s.start, s.end)]
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _sample_positions(self, batch: list[ScheduledSeq]) -> list[int]:
        """Packed index of the last token of every sequence that samples this step."""
        ends, total = [], 0
        for s in batch:
            total += s.num_new_tokens
            if s.needs_sample:
                ends.append(total - 1)
        return ends

    def _prompt_positions(self, batch: list[ScheduledSeq]) -> list[list[int]]:
        """Per batch entry, the packed indices of the prompt positions whose logprobs it wants."""
        starts = [0, *itertools.accumulate(s.num_new_tokens for s in batch)]
        return [[first + p - s.start for p in prompt_positions(s.seq, s.start, s.end)]
                for first, s in zip(starts, batch, strict=False)]
