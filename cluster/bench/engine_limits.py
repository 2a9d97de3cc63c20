"""What the machine allows at best, measured on the engine's own model and thread count.

Two yardsticks:
- prefill: the model's own linear layers run bare (`F.linear` on each `nn.Linear` weight,
  in the model's order) on a `[chunk_tokens, in_features]` input, `lm_head` on one row
  (the engine computes logits for a prompt's last token only). No attention, norms,
  activations or Python around them: a prefill step cannot be faster than this.
- decode: reading every weight once plus the KV the batch attends, at the machine's
  memory read bandwidth, measured as a sum over a tensor far larger than the caches
  (`READ_BYTES`), with the same torch threads. A decode step cannot be faster than this.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

READ_BYTES = 1 << 30  # 32x this machine's 32 MiB L3; any last-level cache today is far smaller
NUM_REPEATS = 5


def median_time(fn: Callable[[], object], num_repeats: int = NUM_REPEATS) -> float:
    """Median wall seconds of `fn()` over `num_repeats` calls after one untimed call."""
    fn()
    times = []
    for _ in range(num_repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def linear_weights(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every `nn.Linear` weight of `model` by name, in module order (lm_head last)."""
    return [(name, m.weight) for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]


@torch.inference_mode()
def bare_matmul(model: torch.nn.Module, chunk_tokens: int, num_repeats: int = NUM_REPEATS) -> dict:
    """Tokens/s of a prefill step that were only its matmuls, at `chunk_tokens` tokens."""
    weights = linear_weights(model)
    inputs = {w.shape[1]: torch.randn(chunk_tokens, w.shape[1], dtype=w.dtype, device=w.device)
              for _, w in weights}

    def step() -> None:
        for name, w in weights:
            x = inputs[w.shape[1]]
            F.linear(x[-1:] if name.endswith("lm_head") else x, w)

    seconds = median_time(step, num_repeats)
    return {"chunk_tokens": chunk_tokens, "step_s": round(seconds, 6),
            "tokens_per_s": round(chunk_tokens / seconds, 1), "num_linear_layers": len(weights),
            "how": f"F.linear of every nn.Linear weight on a [{chunk_tokens}, in_features] input "
                   f"(lm_head on its last row), median of {num_repeats}"}


@torch.inference_mode()
def read_bandwidth(num_bytes: int = READ_BYTES, num_repeats: int = NUM_REPEATS) -> dict:
    """Bytes/s of a streaming read: `sum` over a float32 tensor of `num_bytes`."""
    data = torch.ones(num_bytes // 4, dtype=torch.float32)  # written once, so every page is real
    seconds = median_time(data.sum, num_repeats)
    return {"bytes_per_s": round(num_bytes / seconds), "gb_per_s": round(num_bytes / seconds / 1e9, 2),
            "how": f"torch.sum over a {num_bytes >> 20} MiB float32 tensor, {torch.get_num_threads()} "
                   f"threads, median of {num_repeats}"}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads of the weights: all parameters but the input embedding
    table, of which it reads one row per token (unless lm_head shares it)."""
    embedding = model.get_input_embeddings().weight
    shared = embedding is model.get_output_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if shared or p is not embedding)


def decode_floor_s(weight_nbytes: int, kv_bytes_per_token: int, batch: int, context: int,
                   bytes_per_s: float) -> float:
    """Seconds to read the weights once and `batch` sequences' KV of `context` tokens."""
    return (weight_nbytes + batch * context * kv_bytes_per_token) / bytes_per_s
