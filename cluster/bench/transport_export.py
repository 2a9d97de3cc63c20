"""`bench transport`'s prefill side: the export copy that turns a layer's KV blocks into
the payload a sink sends (`copy_from_blocks`, with its checksum), and what that copy
costs, into fresh tensors and into a sender's reused export buffers (`ExportPool`). It
happens before a layer's first byte is sent, so it is reported apart from the transfer
figures."""

from __future__ import annotations

import statistics
import time

import torch

from transport.base import new_payload_digest
from transport.export_pool import ExportPool
from transport.memory_target import synthetic_layers
from transport.wire import payload_checksum
from workers.engine.kv_cache import copy_from_blocks, tensor_bytes
from workers.engine.kv_types import KVLayout


def exported_layers(layout: KVLayout, num_blocks: int, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    """`(kv, checksum)` per layer, as the prefill engine's export copy makes them."""
    out = []
    for pool in synthetic_layers(layout, num_blocks, seed):
        digest = new_payload_digest()
        out.append((copy_from_blocks(pool, list(range(num_blocks)), digest), digest.intdigest()))
    return out


def export_cost(layout: KVLayout, num_blocks: int, repeats: int) -> dict:
    """ms to export every layer of `num_blocks` (the prefill side, outside a transfer's
    time): the copy alone into a fresh tensor, the same feeding the checksum, the checksum
    on its own, and both copies again into buffers lent by a sender's `ExportPool`, in
    steady state (after one untimed round; each buffer given back once its layer is
    copied, as a send that finished would)."""
    pools, ids = synthetic_layers(layout, num_blocks, 1), list(range(num_blocks))
    export_pool = ExportPool()

    def ms(fn, warm_up: bool = False) -> float:
        times = []
        for i in range(repeats + warm_up):
            t0 = time.perf_counter()
            for pool in pools:
                fn(pool)
            if i or not warm_up:
                times.append(time.perf_counter() - t0)
        return round(statistics.median(times) * 1000, 3)

    def pooled(pool: torch.Tensor, digest=None) -> None:
        lease = export_pool.lend(pool.numel() * pool.element_size())
        copy_from_blocks(pool, ids, digest, None if lease is None else lease.buffer)
        if lease is not None:
            lease.release()

    return {"bytes": sum(p.numel() * p.element_size() for p in pools),
            "copy_ms": ms(lambda p: copy_from_blocks(p, ids)),
            "copy_and_checksum_ms": ms(lambda p: copy_from_blocks(p, ids, new_payload_digest())),
            "checksum_only_ms": ms(lambda p: payload_checksum(tensor_bytes(p))),
            "pooled_copy_ms": ms(pooled, warm_up=True),
            "pooled_copy_and_checksum_ms": ms(lambda p: pooled(p, new_payload_digest()), warm_up=True)}
