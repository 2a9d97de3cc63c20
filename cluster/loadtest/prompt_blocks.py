"""What a run keeps of each prompt instead of its text: one short hash per block of its
bytes, and a per-run salt that gives a repeated run fresh prompt bytes.

Block hashes are positional and unchained (block i hashes bytes [16 i, 16 i + 16) alone),
so a reader can find both the prefix two prompts share (the longest common run of leading
hashes) and content they share after an early difference, which a chained prefix hash
hides. That is what tells "dynamic content placed before a stable prompt" from prompts
that simply differ. The hash is blake2b over the bytes: it cannot be read back as text.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

from cluster.loadtest.workloads import RequestSpec

BLOCK_BYTES = 16
HASH_HEX = 12  # 48 bits: collisions among a run's blocks are negligible
SALT_CHARS = 8  # shorter than one KV block, so the salt alone never makes a shared block


def prompt_block_hashes(prompt: str, block_bytes: int = BLOCK_BYTES) -> list[str]:
    """Hashes of every full block of the prompt's UTF-8 bytes, in order."""
    data = prompt.encode("utf-8")
    return [hashlib.blake2b(data[i:i + block_bytes], digest_size=HASH_HEX // 2).hexdigest()
            for i in range(0, len(data) - block_bytes + 1, block_bytes)]


def salted(spec: RequestSpec, salt: str) -> RequestSpec:
    """`spec` with the first characters of its first message replaced by `salt`: the same
    lengths, the same sharing between the run's own requests (every request gets the same
    salt), and no prefix-cache hit on an earlier run with another salt."""
    if not salt or not spec.messages:
        return spec
    first = dict(spec.messages[0])
    content = str(first.get("content", ""))
    first["content"] = (salt + content[len(salt):]) if len(content) >= len(salt) else salt[:len(content)]
    return replace(spec, messages=(first, *spec.messages[1:]))


def run_salt(seed: int | str, run_index: int) -> str:
    """A deterministic salt of `SALT_CHARS` lowercase letters for one run of a series
    (`seed` may carry a per-series nonce, so another series never repeats its bytes)."""
    digest = hashlib.blake2b(f"{seed}:{run_index}".encode(), digest_size=SALT_CHARS).digest()
    return "".join(chr(ord("a") + b % 26) for b in digest)
