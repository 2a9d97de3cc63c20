"""One short run on a GPU machine that proves what CPU tests cannot: `python -m cluster.bench.gpu_check`.

1. The engine generates in bf16 on CUDA (a tiny random model made in a temp dir).
2. Two processes move bf16 CUDA layers through the real `shm` sender and receiver, and
   the layers land bit-identical through CUDA IPC device slots (not staged via host memory).
3. Decode steps replayed from captured CUDA graphs give the eager step's logits (fp32,
   tiny model), and the model runner's decode step time with and without graphs at batch
   1, 8, 32 and contexts 512, 2,048 (bf16, `small` preset) is reported.

Prints one JSON line of results; exits 1 if a check failed. Without CUDA it says so and
prints `{"cuda": false}` (exit 0), so CPU tests can run it. Ray is never imported: the GPU
machine this is meant for has none.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import tempfile
import time

import torch

LAYERS, BLOCKS, TIMEOUT_S = 4, 8, 60.0
DECODE_SHAPES = ((1, 512), (8, 512), (32, 512), (1, 2048), (8, 2048), (32, 2048))  # (batch, context)
# fp32 graph and eager steps differ only in summation order (padded group vs in place).
GRAPH_LOGIT_TOLERANCE = 1e-3


def _config():
    from transport.config import TransportConfig

    return TransportConfig(backend="shm", host="127.0.0.1", transfer_timeout_s=TIMEOUT_S,
                           reservation_ttl_s=TIMEOUT_S, connect_timeout_s=TIMEOUT_S)


def _layout():
    from transport.memory_target import make_layout

    return make_layout(num_layers=LAYERS, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")


def check_engine(model_dir: str) -> dict:
    from workers.engine import LLMEngine, SamplingParams

    engine = LLMEngine(model_dir, block_size=16, num_kv_blocks=64, device="cuda", dtype="bfloat16")
    engine.add_request("gpu-check", [(7 * i + 3) % 250 for i in range(40)],
                       SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    tokens = out[-1].token_ids
    return {"engine_ok": len(tokens) == 8, "engine_tokens": tokens}


def check_decode_graphs(model_dir: str, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                        shapes: tuple[tuple[int, int], ...] = DECODE_SHAPES, num_steps: int = 20,
                        graph_capture=None) -> list[dict]:
    """Per (batch, context): the runner's decode step (median ms) eager and from graphs, and
    the largest logit difference between the two on that step. `graph_capture` stands in
    for `torch.cuda.graph` where there is none (CPU tests of this harness)."""
    from workers.engine.decode_probe import blocks_needed, decode_batch, randomize_kv, time_decode
    from workers.engine.model_runner import ModelRunner

    num_blocks = max(blocks_needed(b, c, 16) for b, c in shapes)
    runners = {graphs: ModelRunner(model_dir, torch.device(device), dtype, 16, num_blocks, 0.9, 0,
                                   cuda_graphs=graphs, max_num_seqs=max(b for b, _ in shapes),
                                   graph_capture=graph_capture if graphs else None)
               for graphs in (False, True)}
    for runner in runners.values():
        randomize_kv(runner)
    rows = []
    for batch, context in shapes:
        scheduled = decode_batch(batch, context, 16)
        eager_logits, graph_logits = (runners[g].run(scheduled, [])[0] for g in (False, True))
        eager, graphed = (time_decode(runners[g], batch, context, num_steps) for g in (False, True))
        rows.append({"batch": batch, "context": context, "eager_ms": eager.step_ms, "graph_ms": graphed.step_ms,
                     "speedup": round(eager.step_ms / graphed.step_ms, 2),
                     "max_logit_diff": float((eager_logits - graph_logits).abs().max())})
    return rows


def check_graphs(model_dir: str, timing_model_dir: str) -> dict:
    """Graphs agree with eager steps in fp32, then the bf16 timings."""
    agreement = check_decode_graphs(model_dir, "cuda", torch.float32, ((1, 40), (3, 100), (8, 300)), num_steps=1)
    timings = check_decode_graphs(timing_model_dir, "cuda", torch.bfloat16)
    return {"graphs_ok": all(r["max_logit_diff"] < GRAPH_LOGIT_TOLERANCE for r in agreement),
            "graphs_fp32_max_logit_diff": max(r["max_logit_diff"] for r in agreement),
            "decode_steps_bf16_small": timings}


def _send(key: str, jobs: list[tuple[str, str, int]], device: str, results) -> None:
    """Child process: send each job's layers, from CUDA, one transfer after another (the
    first opens the channel; later ones go after the receiver answered the IPC probe)."""
    from transport.factory import make_sender
    from transport.memory_target import synthetic_layers

    sender, layout = make_sender(_config(), key.encode()), _layout()
    try:
        for tid, address, seed in jobs:
            sink = sender.open(tid, address, layout)
            for i, kv in enumerate(synthetic_layers(layout, BLOCKS, seed)):
                sink.on_layer(i, kv.to(device))
            sink.on_complete(seed)
            sink.wait(TIMEOUT_S)
        results.put("ok")
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        results.put(f"{type(exc).__name__}: {exc}")
    finally:
        sender.close()


def check_ipc_transfer(device: str = "cuda") -> dict:
    """`device="cpu"` runs the same exchange through host slots (CPU tests check the harness)."""
    from transport.config import generate_key
    from transport.factory import make_receiver
    from transport.memory_target import MemoryTarget

    key, layout = generate_key(), _layout()
    target = MemoryTarget(layout, 4 * BLOCKS)
    target.layers = [layer.to(device) for layer in target.layers]
    receiver = make_receiver(_config(), target, key.encode())
    jobs = [(f"gpu-check-{i}", receiver.address, i) for i in range(3)]
    reservations = {tid: target.reserve(tid, BLOCKS) for tid, _, _ in jobs}
    for tid, res in reservations.items():
        receiver.expect(tid, res)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_send, args=(key, jobs, device, results), daemon=True)
    proc.start()
    try:
        identical = all(_landed(receiver, target, res, seed) for (tid, _, seed), res
                        in zip(jobs, reservations.values(), strict=True))
        sender_status = results.get(timeout=TIMEOUT_S)
        device_half = receiver._paths["shm"]._device  # noqa: SLF001 - what the check is about
        device_mappings = len(device_half._mappings) if device_half is not None else 0  # noqa: SLF001
    finally:
        proc.join(timeout=10)
        receiver.close()
    return {"ipc_bit_identical": identical, "ipc_sender": sender_status,
            "ipc_device_mappings": device_mappings}


def _landed(receiver, target, res, seed: int) -> bool:
    from transport.memory_target import synthetic_layers

    if receiver.wait(res.transfer_id, TIMEOUT_S).token_id != seed:
        return False
    index = torch.tensor(res.block_ids, device=target.layers[0].device)
    sent = synthetic_layers(target.layout, BLOCKS, seed)
    return all(torch.equal(target.layers[i].index_select(1, index).cpu(), kv) for i, kv in enumerate(sent))


def run() -> dict:
    if not torch.cuda.is_available():
        print("no CUDA here: nothing to check (run this on the GPU machine)", file=sys.stderr)
        return {"cuda": False}
    from workers.model_files import make_model

    start = time.monotonic()
    result: dict = {"cuda": True, "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        tiny = str(make_model(f"{tmp}/tiny", "tiny", 0))
        result.update(check_engine(tiny))
        result.update(check_graphs(tiny, str(make_model(f"{tmp}/small", "small", 0))))
    result.update(check_ipc_transfer())
    result["ok"] = (result["engine_ok"] and result["ipc_bit_identical"] and result["ipc_sender"] == "ok"
                    and result["ipc_device_mappings"] > 0 and result["graphs_ok"])
    result["seconds"] = round(time.monotonic() - start, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(prog="python -m cluster.bench.gpu_check", description=__doc__.split("\n\n")[0]).parse_args(argv)
    result = run()
    print(json.dumps(result), flush=True)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
