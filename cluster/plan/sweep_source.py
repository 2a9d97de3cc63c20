"""A calibration from an offline sweep of the engine on this machine: build `LLMEngine`
with the deployment's default `EngineSettings` on the device asked for, run
`cluster/plan/sweep.py`'s grid through it, fit and score its step records.

The device written is the one the engine ran on (a GPU's name on CUDA), never the one
asked for: nothing is invented. A sweep has no HTTP hop, no router and no KV transfers,
so `request_overhead_s` stays 0 and the transfer model is the policy's cold default;
the notes say both.
"""

from __future__ import annotations

import time
from pathlib import Path

from cluster.config import EngineSettings
from cluster.plan.calibration import Calibration, EngineLimits
from cluster.plan.fit import fit_and_score, fit_transfers
from cluster.plan.model_facts import engine_version
from cluster.plan.records import ReplicaStep
from cluster.plan.sweep import REPEATS, OnPoint, run_sweep, sweep_grid

DEFAULT_TORCH_THREADS = 1  # a pool's default `torch_threads`: the replicas being planned run so
# A CPU sweep's own KV pool (64 MiB on tiny): the grid's largest point fits, and zeroing
# the deployed default (1 GiB) would take longer than the sweep. The pool's size does not
# change a step's cost; the limits written are the deployed pool's.
SWEEP_KV_BLOCKS = 8192


def _deployed_num_blocks(model_dir: str | Path, block_size: int, device: str, dtype: str) -> int | None:
    """The KV pool a deployed CPU replica gets by default (`kv_cache.auto_num_blocks`);
    None on a GPU, where the engine sizes it from free memory once the model is loaded
    (and the sweep's engine does the same)."""
    import torch
    from transformers import AutoConfig

    from workers.engine.kv_cache import auto_num_blocks, layout_from_config
    from workers.engine.model_runner import resolve_dtype

    if device != "cpu":
        return None
    layout = layout_from_config(AutoConfig.from_pretrained(model_dir), block_size, resolve_dtype(dtype))
    return auto_num_blocks(layout, torch.device("cpu"))


def from_sweep(model_dir: str | Path, device: str = "cpu", dtype: str = "float32",
               torch_threads: int = DEFAULT_TORCH_THREADS, max_points: int | None = None,
               settings: EngineSettings | None = None, on_point: OnPoint | None = None,
               on_grid=None) -> Calibration:
    """Sweep the engine in this process (its torch thread count set to `torch_threads`
    for the sweep and put back after)."""
    import torch

    from workers.engine.llm_engine import LLMEngine

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device here; a GPU calibration must run on the GPU")
    settings = settings or EngineSettings()
    threads = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        pool_blocks = settings.num_kv_blocks or _deployed_num_blocks(model_dir, settings.block_size, device, dtype)
        sweep_blocks = min(pool_blocks, SWEEP_KV_BLOCKS) if pool_blocks else None
        engine = LLMEngine(str(model_dir), **settings.model_dump(exclude={"warmup", "num_kv_blocks"}),
                           num_kv_blocks=sweep_blocks, device=device, dtype=dtype)
        points = sweep_grid(engine, max_points)
        if on_grid is not None:
            on_grid(len(points))
        started = time.perf_counter()
        result = run_sweep(engine, points, on_point=on_point,
                           check_contention=engine.device.type == "cpu" and torch_threads == 1)
        sweep_s = time.perf_counter() - started
    finally:
        torch.set_num_threads(threads)
    step, quality = fit_and_score([ReplicaStep("sweep", "decode", r) for r in result.records])
    transfer, transfer_note = fit_transfers([])
    ran_on = torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu"
    notes = [f"offline sweep of {len(points)} points in {sweep_s:.1f} s, {torch_threads} torch thread(s): "
             f"{len(result.records)} steps, each the median of its {REPEATS} repeats "
             f"({result.num_contended} repeats' steps left out as contended)",
             transfer_note, "request_overhead_s: a sweep has no HTTP hop or router; left at 0"]
    limits = EngineLimits(block_size=settings.block_size, num_kv_blocks=pool_blocks or engine.block_manager.num_blocks,
                          max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
                          enable_prefix_caching=settings.enable_prefix_caching,
                          kv_bytes_per_token=engine.kv_bytes_per_token, num_layers=engine.layout.num_layers)
    return Calibration(model=Path(model_dir).resolve().name, engine_version=engine_version(), device=ran_on,
                       dtype=dtype, source="sweep", created_at=time.time(), limits=limits, step=step,
                       transfer=transfer, quality=quality, notes="; ".join(notes))
