"""`copy_into_blocks` (the receive-side copy) must equal `index_copy_`, and
`copy_from_blocks` (the export copy) `index_select`, for any block ids; the digest either
feeds must be the checksum of the payload's bytes in order."""

from __future__ import annotations

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

import workers.engine.kv_cache as kv_cache
from workers.engine.kv_cache import block_runs, copy_from_blocks, copy_into_blocks
from workers.engine.kv_types import FramedKV


@given(st.lists(st.integers(0, 40), unique=True, max_size=24))
def test_block_runs_cover_every_id_once_in_order(block_ids):
    expanded = [(dst + i, src + i) for dst, src, n in block_runs(block_ids) for i in range(n)]
    assert expanded == [(b, i) for i, b in enumerate(block_ids)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 31), unique=True, min_size=1, max_size=20),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_copy_into_blocks_matches_index_copy(block_ids, dtype):
    layer = torch.randn(2, 32, 4, 2, 8).to(dtype)
    expected = layer.clone()
    kv = torch.randn(2, len(block_ids), 4, 2, 8).to(dtype)
    expected.index_copy_(1, torch.tensor(block_ids), kv)
    copy_into_blocks(layer, block_ids, kv)
    assert torch.equal(layer.view(torch.uint8) if dtype == torch.bfloat16 else layer,
                       expected.view(torch.uint8) if dtype == torch.bfloat16 else expected)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 31), unique=True, min_size=1, max_size=20),
       st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([1, 40, 4096, 1 << 20]),
       st.booleans())
def test_the_digest_sees_the_source_bytes_in_order(block_ids, dtype, chunk, contiguous):
    """Hashing the blocks as they are written (in pieces of any size, across runs, K then
    V) gives the checksum of the payload as sent, also on the index_copy_ path."""
    layer = torch.zeros(2, 32, 4, 2, 8, dtype=dtype)
    kv = torch.randn(2, len(block_ids), 4, 2, 8).to(dtype)
    if not contiguous:
        kv = torch.randn(2, len(block_ids), 4, 8, 2).to(dtype).transpose(3, 4)
    sent = xxhash.xxh3_64_intdigest(kv.contiguous().view(torch.uint8).numpy().tobytes())
    digest = xxhash.xxh3_64()
    original, kv_cache.DIGEST_CHUNK_BYTES = kv_cache.DIGEST_CHUNK_BYTES, chunk
    try:
        copy_into_blocks(layer, block_ids, kv, digest)
    finally:
        kv_cache.DIGEST_CHUNK_BYTES = original
    assert digest.intdigest() == sent
    assert torch.equal(layer[:, block_ids].view(torch.uint8), kv.contiguous().view(torch.uint8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 31), unique=True, max_size=20),
       st.sampled_from([torch.float32, torch.bfloat16]), st.sampled_from([1, 40, 4096, 1 << 20]),
       st.booleans(), st.booleans())
def test_export_copy_equals_index_select_and_its_digest_the_payload(block_ids, dtype, chunk, hashed,
                                                                      into_buffer):
    """Also into a reused export buffer (stale bytes in it, as a lent one has): the result
    is a view of that buffer, every byte of it overwritten."""
    layer = torch.randn(2, 32, 4, 2, 8).to(dtype)
    expected = layer.index_select(1, torch.tensor(block_ids, dtype=torch.long))
    digest = xxhash.xxh3_64() if hashed else None
    buffer = torch.full((expected.numel() * expected.element_size(),), 0xAB, dtype=torch.uint8)
    original, kv_cache.DIGEST_CHUNK_BYTES = kv_cache.DIGEST_CHUNK_BYTES, chunk
    try:
        out = copy_from_blocks(layer, block_ids, digest, buffer if into_buffer else None)
    finally:
        kv_cache.DIGEST_CHUNK_BYTES = original
    assert out.is_contiguous() and out.dtype == dtype
    if into_buffer:
        assert out.data_ptr() == buffer.data_ptr()
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    if hashed:
        assert digest.intdigest() == xxhash.xxh3_64_intdigest(expected.view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("block_ids", [[0, 32], [-1]])
def test_copy_from_blocks_refuses_ids_outside_the_pool(block_ids):
    with pytest.raises(ValueError):
        copy_from_blocks(torch.zeros(2, 32, 4, 2, 8), block_ids)


@pytest.mark.parametrize("block_ids, shape", [
    ([0, 32], (2, 2, 4, 2, 8)),   # id past the pool
    ([-1], (2, 1, 4, 2, 8)),      # negative id
    ([0, 1], (2, 3, 4, 2, 8)),    # more source blocks than ids
    ([0], (2, 1, 4, 2, 4)),       # wrong block geometry
])
def test_copy_into_blocks_refuses_what_would_overrun(block_ids, shape):
    layer = torch.zeros(2, 32, 4, 2, 8)
    with pytest.raises(ValueError):
        copy_into_blocks(layer, block_ids, torch.ones(shape))
    assert not layer.any()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 31), unique=True, min_size=1, max_size=20),
       st.sampled_from([torch.float32, torch.bfloat16]), st.lists(st.integers(1, 700), max_size=8),
       st.sampled_from([7, 4096, 1 << 20]))
def test_a_payload_in_frames_lands_as_the_whole_tensor_would(block_ids, dtype, cuts, chunk):
    """A layer received as several frames, cut anywhere (mid-element, mid-block, across
    K and V), is copied from one cursor over them: the same blocks and the same digest."""
    kv = torch.randn(2, len(block_ids), 4, 2, 8).to(dtype)
    raw = kv.view(torch.uint8).reshape(-1)
    bounds = sorted({min(c * 7, raw.numel()) for c in cuts} | {0, raw.numel()})
    pieces = tuple(raw[a:b].clone() for a, b in zip(bounds, bounds[1:], strict=False))
    expected, layer = torch.zeros(2, 32, 4, 2, 8, dtype=dtype), torch.zeros(2, 32, 4, 2, 8, dtype=dtype)
    want, got = xxhash.xxh3_64(), xxhash.xxh3_64()
    copy_into_blocks(expected, block_ids, kv, want)
    original, kv_cache.DIGEST_CHUNK_BYTES = kv_cache.DIGEST_CHUNK_BYTES, chunk
    try:
        copy_into_blocks(layer, block_ids, FramedKV(pieces, tuple(kv.shape), dtype), got)
    finally:
        kv_cache.DIGEST_CHUNK_BYTES = original
    assert torch.equal(layer.view(torch.uint8), expected.view(torch.uint8))
    assert got.intdigest() == want.intdigest()


def test_framed_payload_must_add_up_to_its_shape():
    with pytest.raises(ValueError):
        FramedKV((torch.zeros(10, dtype=torch.uint8),), (2, 1, 4, 2, 8), torch.float32)
