"""Sealed msgpack: a map packed with msgpack and authenticated with HMAC-SHA256.

Both of the cluster's control channels use this one primitive: the KV transport's headers
(transport/wire.py) and the router<->worker stream (workers/stream/wire.py). A sealed
message is the frames `[body, mac]`, `mac` = HMAC-SHA256(key, domain + body). Each channel
has its own domain tag, so a message sealed for one never verifies on another even under
the same key. Tags end in one NUL and hold no other, so no tag is a prefix of another and
`domain + body` names its channel unambiguously.

Opening checks, in this order and before anything is parsed: the body's size, then the MAC
(in constant time); only then is the body unpacked, with hard limits on what the parser may
allocate. Nothing here ever unpickles.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

import msgpack

MAC_LEN = 32
MIN_KEY_LEN = 16


class SealError(Exception):
    """A sealed message was refused; `reason` is the rejection counter it belongs to."""

    reason = "malformed"


class TooLarge(SealError):
    """The body is over the size limit; refused before its MAC is computed."""

    reason = "bounds"


class BadMac(SealError):
    """The MAC does not verify: not sealed with this key for this domain."""

    reason = "bad_mac"


class Malformed(SealError):
    """Authentic, but not a msgpack map within the parser's limits."""

    reason = "malformed"


@dataclass(frozen=True)
class UnpackLimits:
    """What the parser may allocate for one message."""

    max_bytes: int
    max_str_len: int
    max_array_len: int
    max_map_len: int


def check_domain(domain: bytes) -> bytes:
    if not domain.endswith(b"\0") or domain.count(b"\0") != 1 or len(domain) < 2:
        raise ValueError("a domain tag is a non-empty name followed by exactly one NUL")
    return domain


class SealedCodec:
    """Seals maps under one key and one domain tag and opens only what verifies."""

    def __init__(self, key: bytes, domain: bytes, limits: UnpackLimits) -> None:
        if len(key) < MIN_KEY_LEN:
            raise ValueError(f"the transport key must be at least {MIN_KEY_LEN} bytes")
        # The key and domain are absorbed once; each message copies this state.
        self._keyed = hmac.new(key, check_domain(domain), hashlib.sha256)
        self.domain = domain
        self.limits = limits

    def __repr__(self) -> str:  # never show the key
        return f"SealedCodec(domain={self.domain!r}, limits={self.limits})"

    def mac(self, body: bytes) -> bytes:
        h = self._keyed.copy()
        h.update(body)
        return h.digest()

    def seal(self, message: dict[str, Any]) -> list[bytes]:
        body = msgpack.packb(message, use_bin_type=True)
        return [body, self.mac(body)]

    def open(self, body: bytes, mac: bytes) -> dict[str, Any]:
        """Size, then MAC, then parse. Raises TooLarge, BadMac or Malformed."""
        lim = self.limits
        if len(body) > lim.max_bytes:
            raise TooLarge(f"{len(body)} bytes exceed the limit of {lim.max_bytes}")
        if len(mac) != MAC_LEN or not hmac.compare_digest(self.mac(body), mac):
            raise BadMac("MAC does not verify")
        try:
            message = msgpack.unpackb(
                body, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0,
                max_str_len=lim.max_str_len, max_array_len=lim.max_array_len,
                max_map_len=lim.max_map_len)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a malformed message
            raise Malformed(f"undecodable: {type(exc).__name__}") from None
        if not isinstance(message, dict):
            raise Malformed("not a map")
        return message
