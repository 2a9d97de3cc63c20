"""Chained hashes of full KV blocks: the identity of a cached prefix.

Prefill and decode engines on different machines, and the router, must agree on these
numbers without talking to each other, so the hash is a fixed function of the token ids
(blake2b over little-endian int64s) and never Python's per-process salted `hash`.
Each block's hash covers its parent's hash, so equal hashes mean equal whole prefixes.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

ROOT_HASH = 0  # the parent of the first block


def hash_block(parent_hash: int, block_token_ids: Sequence[int]) -> int:
    """The hash of one full block given the hash of the block before it."""
    blob = struct.pack(f"<Q{len(block_token_ids)}q", parent_hash, *block_token_ids)
    return int.from_bytes(hashlib.blake2b(blob, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Hashes of every FULL block of `token_ids`, in order; a partial tail is left out.
    The same bytes `hash_block` hashes, packed once for the whole prompt (the router
    hashes every request's prompt), the chain carried as the digest itself: its bytes
    are the parent hash's little-endian bytes."""
    if block_size < 1:
        raise ValueError("block_size must be at least 1")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    num_tokens = num_full * block_size
    ids = token_ids if len(token_ids) == num_tokens else token_ids[:num_tokens]
    data = struct.pack(f"<{num_tokens}q", *ids)  # half numpy's time from a Python list
    width = 8 * block_size
    blake2b = hashlib.blake2b
    digests: list[bytes] = []
    parent = ROOT_HASH.to_bytes(8, "little")
    for start in range(0, len(data), width):
        h = blake2b(parent, digest_size=8)
        h.update(data[start:start + width])
        parent = h.digest()
        digests.append(parent)
    return np.frombuffer(b"".join(digests), dtype="<u8").tolist()  # one conversion, not one per block
