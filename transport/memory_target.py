"""An in-memory `KVTarget`: a block pool without a model, for tests and the benchmark.

It keeps the same bookkeeping the decode engine does (reserved blocks, cancel frees them,
`check_integrity`), so transport tests can assert that no block leaks on any path.
"""

from __future__ import annotations

import threading

import torch

from workers.engine.kv_cache import copy_into_blocks, tensor_bytes
from workers.engine.kv_types import (
    ByteDigest,
    FramedKV,
    KVLayout,
    KVPayload,
    KVReservation,
    StreamedKV,
)


def make_layout(num_layers: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                block_size: int = 16, dtype: str = "float32") -> KVLayout:
    return KVLayout("synthetic", num_layers, num_kv_heads, head_dim, block_size, dtype)


def synthetic_layers(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Distinct, reproducible layer tensors, as a prefill engine would hand to a sink."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, layout.dtype)
    return [torch.randn(layout.layer_shape(num_blocks), generator=gen).to(dtype)
            for _ in range(layout.num_layers)]


class MemoryTarget:
    def __init__(self, layout: KVLayout, num_blocks: int, allocate: bool = True) -> None:
        self._layout = layout
        self.num_blocks = num_blocks
        self._lock = threading.Lock()
        self._free = list(range(num_blocks))
        self.reservations: dict[str, KVReservation] = {}
        self.write_log: list[tuple[str, int]] = []  # (transfer id, layer) in arrival order
        dtype = getattr(torch, layout.dtype)
        # allocate=False: skip the pool (the benchmark times one copy into a scratch layer)
        self.layers = [torch.zeros(layout.layer_shape(num_blocks if allocate else 0), dtype=dtype)
                       for _ in range(layout.num_layers)]
        self.allocate = allocate

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def reserve(self, transfer_id: str, num_blocks: int) -> KVReservation | None:
        with self._lock:
            if num_blocks > len(self._free):
                return None
            block_ids, self._free = self._free[:num_blocks], self._free[num_blocks:]
            res = KVReservation(transfer_id, [0] * num_blocks * self._layout.block_size,
                                block_ids, 0, self._layout)
            self.reservations[transfer_id] = res
            return res

    def write_kv_layer(self, res: KVReservation, layer_idx: int, kv: KVPayload,
                       digest: ByteDigest | None = None) -> None:
        if res.transfer_id not in self.reservations:
            raise KeyError(f"transfer {res.transfer_id!r} is not reserved")
        expected = self._layout.layer_shape(res.num_blocks_to_receive)
        if tuple(kv.shape) != expected:
            raise ValueError(f"shape {tuple(kv.shape)} != {expected}")
        if self.allocate:
            copy_into_blocks(self.layers[layer_idx], res.block_ids[res.num_cached_blocks:], kv, digest)
        else:  # no pool, yet a streamed payload must still leave its socket
            kv = kv.joined() if isinstance(kv, StreamedKV) else kv
            for piece in kv.pieces if isinstance(kv, FramedKV) else (kv.contiguous(),):
                if digest is not None:
                    digest.update(tensor_bytes(piece))
        res.layers_written.add(layer_idx)
        with self._lock:
            self.write_log.append((res.transfer_id, layer_idx))

    def read(self, res: KVReservation, layer_idx: int) -> torch.Tensor:
        index = torch.tensor(res.block_ids[res.num_cached_blocks:], dtype=torch.long)
        return self.layers[layer_idx].index_select(1, index)

    def commit(self, res: KVReservation) -> None:
        """Stand-in for `commit_kv`: the request finished, its blocks return."""
        self.cancel_kv(res)

    def cancel_kv(self, res: KVReservation) -> None:
        with self._lock:
            if self.reservations.pop(res.transfer_id, None) is not None:
                self._free.extend(res.block_ids)

    @property
    def num_free_blocks(self) -> int:
        with self._lock:
            return len(self._free)

    def check_integrity(self) -> None:
        with self._lock:
            held = [b for r in self.reservations.values() for b in r.block_ids]
            assert len(set(held)) == len(held), "a block is reserved twice"
            assert sorted(held + self._free) == list(range(self.num_blocks)), "blocks leaked"
