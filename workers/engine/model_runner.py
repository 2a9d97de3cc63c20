"""Runs one scheduled step through the real transformers model on the paged cache.

All scheduled tokens are packed into one row (batch dim 1) with explicit `position_ids`;
`use_cache=False` keeps transformers' DynamicCache out, the paged attention function
reads and writes our own cache, and only the last token of each sequence that samples
this step goes through `lm_head` (plus, for a request that asks for prompt logprobs, the
prompt positions it computes this step). With CUDA graphs on, a step of decodes only is
replayed from a captured graph instead (cuda_graphs.py).
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
from workers.engine.cuda_graphs import (
    Capture,
    DecodeBuffers,
    DecodeGraphs,
    DecodeInputs,
    cuda_capture,
)
from workers.engine.kv_cache import KVCache, auto_num_blocks, layout_from_config
from workers.engine.prompt_logprobs import prompt_positions
from workers.engine.scheduler import ScheduledSeq
from workers.engine.sdpa_backend import SdpaBackend

DEFAULT_MAX_GRAPH_BATCH = 64  # the engine's default max_num_seqs


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    resolved = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if resolved not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    return resolved


class ModelRunner:
    def __init__(self, model_dir: str, device: torch.device, dtype: torch.dtype, block_size: int,
                 num_kv_blocks: int | None, gpu_memory_fraction: float, cpu_kv_bytes: int,
                 backend: AttentionBackend | None = None, *, cuda_graphs: bool | None = None,
                 max_num_seqs: int = DEFAULT_MAX_GRAPH_BATCH, graph_capture: Capture | None = None) -> None:
        """`cuda_graphs`: replay decode steps from captured graphs (None: when `device` is
        CUDA), for batches up to `max_num_seqs`; `graph_capture` replaces `torch.cuda.graph`
        (tests on CPU)."""
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.model.config._attn_implementation = register_paged_attention()
        self.config = self.model.config
        self.layout = layout_from_config(self.config, block_size, dtype)
        num_blocks = num_kv_blocks or auto_num_blocks(self.layout, device, gpu_memory_fraction, cpu_kv_bytes)
        self.kv_cache = KVCache(self.layout, num_blocks, device)
        self.backend = backend or SdpaBackend()
        self.graphs = self._decode_graphs(cuda_graphs, max_num_seqs, graph_capture)

    @property
    def max_model_len(self) -> int:
        """Context the engine serves exactly: capped at a sliding window, which the SDPA
        backend does not apply (every token attends to its whole context)."""
        window = getattr(self.config, "sliding_window", None)
        if window and getattr(self.config, "use_sliding_window", True):
            return min(window, self.config.max_position_embeddings)
        return self.config.max_position_embeddings

    def _decode_graphs(self, enabled: bool | None, max_num_seqs: int, capture: Capture | None) -> DecodeGraphs | None:
        if not (enabled if enabled is not None else self.device.type == "cuda"):
            return None
        if capture is None and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device, not {self.device}")
        return DecodeGraphs(self._graph_step, capture or cuda_capture(), max_num_seqs,
                            self.layout.num_blocks(self.max_model_len), self.layout.block_size, self.device)

    @torch.inference_mode()
    def run(self, batch: list[ScheduledSeq], exports: list[KVExport]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Compute `batch`; returns float32 logits `[num_sampling_seqs, vocab]` in batch order,
        and per batch entry the logits of its `prompt_positions` (most often none)."""
        inputs = self._decode_inputs(batch) if self.graphs is not None and not exports else None
        logits = self.graphs.run(inputs) if inputs is not None else None
        if logits is not None:
            return logits, [logits[:0]] * len(batch)
        return self._run_eager(batch, exports)

    def _run_eager(self, batch: list[ScheduledSeq], exports: list[KVExport]) -> tuple[torch.Tensor, list[torch.Tensor]]:
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

    def _decode_inputs(self, batch: list[ScheduledSeq]) -> DecodeInputs | None:
        """The step as a graph's inputs, or None when it is not decodes only (one new token
        each, sampled, no prompt logprobs)."""
        if any(s.num_new_tokens != 1 or not s.needs_sample for s in batch) or any(self._prompt_positions(batch)):
            return None
        return DecodeInputs(token_ids=[s.seq.token_ids[s.start] for s in batch], positions=[s.start for s in batch],
                            slots=self._slots(batch), context_lens=[s.end for s in batch],
                            block_tables=[s.seq.block_ids for s in batch])

    def _graph_step(self, buffers: DecodeBuffers) -> torch.Tensor:
        """The model on a captured step's static buffers: logits `[B, vocab]`. The metadata's
        lists are nominal; the backend state reads only `buffers.attention`."""
        batch = buffers.batch
        meta = AttentionMetadata(kv_cache=self.kv_cache, backend=self.backend,
                                 slot_mapping=buffers.attention.slot_mapping,
                                 query_start_locs=list(range(batch)), query_lens=[1] * batch,
                                 context_lens=[], block_tables=[],
                                 backend_state=self.backend.static_decode_state(buffers.attention))
        out = self.model(input_ids=buffers.input_ids[None], position_ids=buffers.positions[None],
                         use_cache=False, attn_metadata=meta)
        return out.logits[0]

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
        return torch.tensor(self._slots(batch), dtype=torch.long, device=self.device)

    def _slots(self, batch: list[ScheduledSeq]) -> list[int]:
        block_size = self.layout.block_size
        return [s.seq.block_ids[pos // block_size] * block_size + pos % block_size
                for s in batch for pos in range(s.start, s.end)]

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
