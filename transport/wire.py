"""The wire format: one authenticated msgpack header per message, then raw payload frames.

A message is the frames `[header, mac, *payload]`. `mac` is HMAC-SHA256 over the header
bytes with the shared key (`PDC_TRANSPORT_KEY`); the header carries an xxh3-64 checksum
of the payload, so the payload is protected by the MAC without hashing every byte with
SHA-256. The MAC is checked before the header is parsed, and the parser has hard size
limits; nothing on the wire is ever unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass, field, fields

import msgpack

from transport.base import TransferAuthError, TransferCorrupt, TransferRejected, new_payload_digest

PROTOCOL_VERSION = 1
MAC_LEN = 32

# Message kinds. Sender -> receiver: HELLO (data-path handshake), LAYER, DONE, ABORT.
# Receiver -> sender: ACK (transfer complete), NACK (failed, with reason), RELEASE (a
# shared-memory slot may be reused).
HELLO, LAYER, DONE, ABORT, ACK, NACK, RELEASE = (
    "hello", "layer", "done", "abort", "ack", "nack", "release")
KINDS = frozenset((HELLO, LAYER, DONE, ABORT, ACK, NACK, RELEASE))

# Data paths: how a LAYER's bytes travel. inline = ZMQ frames after the header;
# shm = a same-node shared-memory file named in `extra`; pg = a per-pair Gloo/NCCL group;
# tcp = a per-pair TCP stream the receiver reads straight into its KV blocks.
INLINE, SHM, PG, TCP = "inline", "shm", "pg", "tcp"
DATA_PATHS = frozenset((INLINE, SHM, PG, TCP))


@dataclass
class Header:
    kind: str
    transfer_id: str
    seq: int = 0  # per transfer, from 0; the receiver accepts exactly the next one
    layer_start: int = 0
    layer_end: int = 0  # exclusive
    dtype: str = ""
    shape: list[int] = field(default_factory=list)
    block_size: int = 0
    fingerprint: str = ""  # KVLayout.fingerprint() of the sender's engine
    nbytes: int = 0
    checksum: int = 0  # xxh3-64 of the payload bytes
    data_path: str = INLINE
    first_token_id: int = -1  # DONE only
    error: str = ""  # NACK/ABORT: TransferError.kind
    reason: str = ""  # NACK/ABORT: finer cause
    detail: str = ""  # NACK/ABORT: human-readable message
    extra: dict[str, str | int] = field(default_factory=dict)  # data-path specifics
    version: int = PROTOCOL_VERSION


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    f.name: {"int": int, "str": str, "list[int]": list,
             "dict[str, str | int]": dict}[str(f.type)]
    for f in fields(Header)
}


@dataclass(frozen=True)
class WireLimits:
    """Receiver-side bounds on what the parser will allocate for a header."""

    max_header_bytes: int = 16 << 10
    max_str_len: int = 4096
    max_array_len: int = 16  # shape has 5-6 dims
    max_map_len: int = 32


def payload_checksum(*buffers: memoryview | bytes) -> int:
    """`new_payload_digest()` of the bytes, in one pass."""
    h = new_payload_digest()
    for buf in buffers:
        h.update(buf)
    return h.intdigest()


class WireCodec:
    """Seals headers with the shared key and opens them with size limits."""

    def __init__(self, key: bytes, limits: WireLimits | None = None) -> None:
        if len(key) < 16:
            raise ValueError("transport key must be at least 16 bytes")
        self._key = key
        self.limits = limits or WireLimits()

    def __repr__(self) -> str:  # never show the key
        return f"WireCodec(limits={self.limits})"

    def seal(self, header: Header) -> list[bytes]:
        # Not dataclasses.asdict: its recursive deep copy cost ~40 us of a ~60 us send.
        blob = msgpack.packb({name: getattr(header, name) for name in _FIELD_TYPES},
                             use_bin_type=True)
        return [blob, hmac.new(self._key, blob, hashlib.sha256).digest()]

    def open(self, blob: bytes, mac: bytes) -> Header:
        """Verify, then parse. Raises TransferAuthError, TransferRejected or TransferCorrupt."""
        if len(blob) > self.limits.max_header_bytes:
            raise TransferRejected(f"header of {len(blob)} bytes exceeds the limit", "bounds")
        expected = hmac.new(self._key, blob, hashlib.sha256).digest()
        if len(mac) != MAC_LEN or not hmac.compare_digest(expected, mac):
            raise TransferAuthError("header MAC does not verify", "bad_mac")
        raw = self._unpack(blob)
        transfer_id = raw.get("transfer_id") if isinstance(raw.get("transfer_id"), str) else ""
        if raw.get("version") != PROTOCOL_VERSION:
            raise TransferRejected(
                f"protocol version {raw.get('version')!r}, expected {PROTOCOL_VERSION}",
                "version", transfer_id)
        return _to_header(raw, transfer_id)

    def _unpack(self, blob: bytes) -> dict:
        lim = self.limits
        try:
            raw = msgpack.unpackb(
                blob, raw=False, strict_map_key=True, max_str_len=lim.max_str_len,
                max_bin_len=0, max_array_len=lim.max_array_len, max_map_len=lim.max_map_len,
                max_ext_len=0)
        except Exception as exc:  # noqa: BLE001 - any parse failure is a corrupt header
            raise TransferCorrupt(f"undecodable header: {type(exc).__name__}", "malformed") from None
        if not isinstance(raw, dict):
            raise TransferCorrupt("header is not a map", "malformed")
        return raw


def _to_header(raw: dict, transfer_id: str) -> Header:
    unknown = set(raw) - set(_FIELD_TYPES)
    if unknown:
        raise TransferCorrupt(f"unknown header fields {sorted(unknown)}", "malformed", transfer_id)
    for name, value in raw.items():
        want = _FIELD_TYPES[name]
        if not isinstance(value, want) or isinstance(value, bool):
            raise TransferCorrupt(f"header field {name} has the wrong type", "malformed",
                                  transfer_id)
    header = Header(**raw)
    ok = (header.kind in KINDS and header.data_path in DATA_PATHS
          and all(isinstance(d, int) and 0 <= d < 1 << 40 for d in header.shape)
          and all(isinstance(v, (str, int)) for v in header.extra.values())
          and header.nbytes >= 0 and header.seq >= 0)
    if not ok:
        raise TransferCorrupt("header values out of range", "malformed", transfer_id)
    return header
