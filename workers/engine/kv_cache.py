"""The paged KV pool: one preallocated tensor per layer, sized once at start-up.

Layer tensors are `[2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`
(`KVLayout.layer_shape`), so a block's K and V for one layer are two contiguous slabs
and a transfer of N blocks is one index along dim 1.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import math

import torch

from workers.engine.kv_types import (
    ByteDigest,
    ByteStream,
    FramedKV,
    KVLayout,
    KVPayload,
    StreamedKV,
)

DEFAULT_GPU_MEMORY_FRACTION = 0.9
DEFAULT_CPU_KV_BYTES = 1 << 30
# A received layer is copied and fed to its checksum in pieces this big, each hashed right
# after it is written while it is still in cache (one memory pass instead of two).
DIGEST_CHUNK_BYTES = 512 << 10

# Config fields that change what a KV entry means; weights are not hashed, the
# architecture is (two checkpoints of one architecture exchange KV at the user's risk).
_FINGERPRINT_FIELDS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rope_parameters", "rope_theta", "rope_scaling",
    "rms_norm_eps", "sliding_window", "attention_bias",
)


def model_fingerprint(config) -> str:
    """A stable hash of the architecture-relevant fields of a transformers config."""
    fields = {name: getattr(config, name, None) for name in _FINGERPRINT_FIELDS}
    blob = json.dumps(fields, sort_keys=True, default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layout_from_config(config, block_size: int, dtype: torch.dtype) -> KVLayout:
    return KVLayout(
        model_fingerprint=model_fingerprint(config),
        num_layers=config.num_hidden_layers,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim_of(config),
        block_size=block_size,
        dtype=str(dtype).removeprefix("torch."),
    )


def bytes_per_block(layout: KVLayout) -> int:
    """Bytes one block occupies across all layers."""
    return layout.num_layers * layout.layer_nbytes(1)


def auto_num_blocks(layout: KVLayout, device: torch.device,
                    gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
                    cpu_kv_bytes: int = DEFAULT_CPU_KV_BYTES) -> int:
    """Blocks that fit: a fraction of free device memory on CUDA, a byte budget elsewhere.

    Call after the model is loaded so its weights are already out of the free memory.
    """
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        budget = int(free_bytes * gpu_memory_fraction)
    else:
        budget = cpu_kv_bytes
    num_blocks = budget // bytes_per_block(layout)
    if num_blocks < 1:
        raise ValueError(f"KV budget of {budget} bytes holds no block of {bytes_per_block(layout)} bytes")
    return num_blocks


class KVCache:
    """Per-layer paged K/V tensors; blocks are handed out by the BlockManager."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device) -> None:
        self.layout = layout
        self.num_blocks = num_blocks
        dtype = getattr(torch, layout.dtype)
        # zeros, not empty: batched decode reads padding slots under a zero attention
        # weight, and 0 * NaN from uninitialised memory would still poison the output.
        self.layers = [torch.zeros(layout.layer_shape(num_blocks), dtype=dtype, device=device)
                       for _ in range(layout.num_layers)]

    def slots_view(self, layer_idx: int) -> torch.Tensor:
        """The layer as `[2, num_blocks * block_size, num_kv_heads, head_dim]` (one row per slot)."""
        kv = self.layers[layer_idx]
        return kv.view(2, -1, *kv.shape[3:])

    def read_blocks(self, layer_idx: int, block_ids: list[int], digest: ByteDigest | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """A contiguous copy of the given blocks: `layout.layer_shape(len(block_ids))`, in
        `out` (a host byte buffer) when given and the cache is in host memory.
        `digest`, if given, is fed the copy's bytes in order (see `copy_from_blocks`)."""
        return copy_from_blocks(self.layers[layer_idx], block_ids, digest, out)

    def copy_block(self, src_id: int, dst_ids: list[int]) -> None:
        """Copy block `src_id`'s KV, every layer, into each of `dst_ids` (copy-on-write of
        the block where forked sequences diverge)."""
        for layer in self.layers:
            layer[:, dst_ids] = layer[:, src_id].unsqueeze(1)

    def write_blocks(self, layer_idx: int, block_ids: list[int], kv: KVPayload,
                     digest: ByteDigest | None = None) -> None:
        expected = self.layout.layer_shape(len(block_ids))
        if tuple(kv.shape) != expected:
            raise ValueError(f"layer {layer_idx}: KV shape {tuple(kv.shape)} != expected {expected}")
        copy_into_blocks(self.layers[layer_idx], block_ids, kv, digest)


def block_runs(block_ids: list[int]) -> list[tuple[int, int, int]]:
    """`(first destination block, first source block, length)` of each run of consecutive
    ids: a freshly reserved range is usually one run, so a layer lands in one or two slabs."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in enumerate(block_ids):
        if runs and runs[-1][0] + runs[-1][2] == dst:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((dst, src, 1))
    return runs


def copy_into_blocks(layer: torch.Tensor, block_ids: list[int], kv: KVPayload,
                     digest: ByteDigest | None = None) -> None:
    """`layer[:, block_ids] = kv`. On CPU, one memmove per (K or V, run of consecutive
    blocks) on the calling thread: ~3x faster than `index_copy_` for a multi-MiB layer, and
    free of torch's intra-op pool (whose barrier stalls when a core is busy elsewhere).

    `digest`, if given, is fed every byte of `kv` in order: on CPU from the blocks just
    written, piece by piece while each piece is in cache, so verifying a received payload
    costs no second pass over memory. (The caller discards the blocks if it then fails.)
    `kv` may be a `FramedKV` (a payload received as several frames): its pieces are copied
    in order, with no joined copy, into a CPU layer; or a `StreamedKV` (a payload still on
    its socket), read straight into a CPU layer's blocks."""
    if kv.shape[0] != 2 or kv.shape[1] != len(block_ids) or kv.shape[2:] != layer.shape[2:]:
        raise ValueError(f"KV shape {tuple(kv.shape)} does not fit {len(block_ids)} blocks "
                         f"of {tuple(layer.shape[2:])}")
    if block_ids and not 0 <= min(block_ids) <= max(block_ids) < layer.shape[1]:
        raise ValueError(f"block ids outside [0, {layer.shape[1]})")  # a memmove must never overrun
    host_layer = layer.device.type == "cpu" and layer.is_contiguous() and kv.dtype == layer.dtype
    if isinstance(kv, StreamedKV) and host_layer:
        _read_spans(layer, block_ids, kv.stream, digest)
        return
    if isinstance(kv, FramedKV) and host_layer:
        _copy_pieces(layer, block_ids, kv.pieces, digest)
        return
    if isinstance(kv, (FramedKV, StreamedKV)):
        kv = kv.joined()
    cpu_bytes = (layer.device.type == "cpu" and kv.device.type == "cpu" and kv.dtype == layer.dtype
                 and layer.is_contiguous() and kv.is_contiguous())
    if not cpu_bytes:
        if digest is not None:
            digest.update(tensor_bytes(kv.detach().cpu().contiguous()))
        index = torch.tensor(block_ids, dtype=torch.long, device=layer.device)
        layer.index_copy_(1, index, kv.to(device=layer.device, dtype=layer.dtype))
        return
    _copy_pieces(layer, block_ids, (kv.reshape(-1).view(torch.uint8),), digest)


def _block_spans(layer: torch.Tensor, block_ids: list[int]) -> list[tuple[int, int, int]]:
    """`(byte offset in the layer, byte offset in the payload, bytes)` of each (K or V, run
    of consecutive blocks), in the payload's byte order (K runs, then V runs): the one
    memmove each that a layer export or import costs."""
    row = layer[0, 0].numel() * layer.element_size()  # bytes of one block's K (or V)
    layer_half, payload_half = layer[0].numel() * layer.element_size(), len(block_ids) * row
    runs = block_runs(block_ids)
    return [(half * layer_half + block * row, half * payload_half + index * row, n * row)
            for half in range(2) for block, index, n in runs]


def _copy_pieces(layer: torch.Tensor, block_ids: list[int], pieces: tuple[torch.Tensor, ...],
                 digest: ByteDigest | None) -> None:
    """Fill the blocks' spans in payload order from one cursor over `pieces` (contiguous
    CPU tensors whose bytes, concatenated, are the payload: one tensor, or the frames it
    arrived in, never joined first)."""
    written = tensor_bytes(layer) if digest is not None else None
    pieces = tuple(p for p in pieces if p.numel())
    piece, pos = 0, 0
    for offset, _, left in _block_spans(layer, block_ids):
        while left:
            size = pieces[piece].numel() * pieces[piece].element_size()
            take = min(left, size - pos)
            memmove_hashed(layer.data_ptr(), offset, pieces[piece].data_ptr() + pos, take, written, digest)
            offset, left, pos = offset + take, left - take, pos + take
            if pos == size:
                piece, pos = piece + 1, 0


def _read_spans(layer: torch.Tensor, block_ids: list[int], stream: ByteStream,
                digest: ByteDigest | None) -> None:
    """Fill the blocks' spans in payload order straight from `stream`, in pieces of
    `DIGEST_CHUNK_BYTES`, each fed to `digest` right after it lands (still in cache)."""
    written = tensor_bytes(layer)
    for offset, _, nbytes in _block_spans(layer, block_ids):
        for start in range(offset, offset + nbytes, DIGEST_CHUNK_BYTES):
            piece = written[start: min(start + DIGEST_CHUNK_BYTES, offset + nbytes)]
            stream.fill(piece)
            if digest is not None:
                digest.update(piece)


def copy_from_blocks(layer: torch.Tensor, block_ids: list[int], digest: ByteDigest | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`layer[:, block_ids]` as a contiguous tensor: the mirror of `copy_into_blocks`.

    `digest`, if given, is fed every byte of the result in order, each piece right after
    it is written (on CPU), so a transport's payload checksum comes with the export copy
    instead of a second pass over the layer on the sending thread. On GPU no digest is fed
    (hashing would cost a device-to-host copy; GPU payloads carry no checksum).

    `out`: a contiguous uint8 CPU tensor of exactly the result's bytes (a sender's reused
    export buffer, already paged in) that the result is a view of, for a CPU layer; the
    result is a fresh tensor when it is None or the layer is not in host memory."""
    if block_ids and not 0 <= min(block_ids) <= max(block_ids) < layer.shape[1]:
        raise ValueError(f"block ids outside [0, {layer.shape[1]})")  # a memmove must never overrun
    if layer.device.type != "cpu" or not layer.is_contiguous():
        index = torch.tensor(block_ids, dtype=torch.long, device=layer.device)
        result = layer.index_select(1, index)
        if digest is not None and result.device.type == "cpu":
            digest.update(tensor_bytes(result))
        return result
    out = _export_destination((2, len(block_ids), *layer.shape[2:]), layer.dtype, out)
    written = tensor_bytes(out) if digest is not None else None
    for layer_offset, out_offset, nbytes in _block_spans(layer, block_ids):
        memmove_hashed(out.data_ptr(), out_offset, layer.data_ptr() + layer_offset, nbytes, written, digest)
    return out


def _export_destination(shape: tuple[int, ...], dtype: torch.dtype,
                        out: torch.Tensor | None) -> torch.Tensor:
    """`out` viewed as a `dtype` tensor of `shape`, or a fresh one; raises unless `out` is
    a contiguous uint8 CPU buffer of exactly that many bytes (a memmove must never overrun)."""
    if out is None:
        return torch.empty(shape, dtype=dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if out.device.type != "cpu" or out.dtype != torch.uint8 or not out.is_contiguous() \
            or out.numel() != nbytes:
        raise ValueError(f"an export buffer must be {nbytes} contiguous host bytes")
    return out.view(dtype).view(shape)


def memmove_hashed(base: int, offset: int, src: int, nbytes: int, written: memoryview | None,
                   digest: ByteDigest | None, chunk: int | None = None) -> None:
    """memmove `nbytes` from address `src` to `base + offset`; with a `digest`, in pieces
    of `chunk` (default `DIGEST_CHUNK_BYTES`), each fed to it from `written` (a byte view
    starting at `base`) right after it lands, while it is still in cache."""
    if digest is None or written is None:
        ctypes.memmove(base + offset, src, nbytes)
        return
    chunk = chunk or DIGEST_CHUNK_BYTES
    for start in range(0, nbytes, chunk):
        size = min(chunk, nbytes - start)
        ctypes.memmove(base + offset + start, src + start, size)
        digest.update(written[offset + start: offset + start + size])


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())
