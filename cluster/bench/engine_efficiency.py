"""The engine against the machine's own limits, in the same run, model and thread count.

Prefill: the engine's tokens/s on a step that computes one fresh `chunk_tokens` prompt,
over the bare matmul throughput of the model's linear layers at that shape (1.0 would be
matmuls and nothing else). Decode: at each batch and context, the weight-and-KV read
floor over the engine's step time (1.0 = the step only reads memory, at full speed).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from cluster.bench.engine_limits import bare_matmul, decode_floor_s, read_bandwidth, weight_bytes
from cluster.bench.engine_shapes import shape_engine, time_decode, time_prefill, warm_up

NUM_DECODE_STEPS = 4  # timed, after one untimed, per shape
NUM_PREFILL_STEPS = 2


def measure_efficiency(model_dir: Path, chunk_tokens: int, decode_batches: tuple[int, ...],
                       decode_contexts: tuple[int, ...], log: Callable[[str], None] = lambda _: None) -> dict:
    """`{"limits": ..., "ratios": ...}`: the yardsticks, the engine at each shape, and the
    `prefill_vs_bare_matmul` and `decode_vs_read_floor_b<batch>_ctx<context>` ratios."""
    engine = shape_engine(str(model_dir), max(decode_batches) * max(decode_contexts), chunk_tokens)
    model = engine.runner.model
    log(f"limits: bare matmuls at {chunk_tokens} tokens, memory read bandwidth ...")
    bare = bare_matmul(model, chunk_tokens)
    bandwidth = read_bandwidth()
    log("limits: the engine's prefill and decode steps at fixed shapes ...")
    warm_up(engine)
    prefill = time_prefill(engine, chunk_tokens, NUM_PREFILL_STEPS)
    prefill_tps = chunk_tokens / prefill.step_s
    weight_nbytes = weight_bytes(model)
    decode = {}
    for batch in decode_batches:
        for context in decode_contexts:
            step_s = time_decode(engine, batch, context, NUM_DECODE_STEPS).step_s
            floor_s = decode_floor_s(weight_nbytes, engine.kv_bytes_per_token, batch, context,
                                     bandwidth["bytes_per_s"])
            decode[f"b{batch}_ctx{context}"] = {"batch": batch, "context": context, "step_s": round(step_s, 6),
                                                "floor_s": round(floor_s, 6), "vs_floor": round(floor_s / step_s, 3)}
    limits = {
        "bare_matmul": bare,
        "read_bandwidth": bandwidth,
        "engine_prefill": {"chunk_tokens": chunk_tokens, "step_s": round(prefill.step_s, 6),
                           "tokens_per_s": round(prefill_tps, 1)},
        "decode_floor": {"weight_bytes": weight_nbytes, "kv_bytes_per_token": engine.kv_bytes_per_token,
                         "how": "(weight_bytes + batch * context * kv_bytes_per_token) / read_bandwidth"},
        "engine_decode": decode,
    }
    ratios = {"prefill_vs_bare_matmul": round(prefill_tps / bare["tokens_per_s"], 3)}
    ratios |= {f"decode_vs_read_floor_{key}": d["vs_floor"] for key, d in decode.items()}
    return {"limits": limits, "ratios": ratios}
