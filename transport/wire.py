"""The KV transport's wire format: one sealed msgpack header per message, then raw payload frames.

A message is the frames `[header, mac, *payload]`: the header is sealed with the shared key
(the transport key, which the app builder resolves once) under this channel's own domain tag (transport/sealed.py), so no
other message sealed with that key verifies as a header. The header carries an xxh3-64
checksum of the payload, so the payload is protected by the MAC without hashing every byte
with SHA-256. The MAC is checked before the header is parsed, the parser has hard size
limits, and nothing on the wire is ever unpickled.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from transport.base import TransferAuthError, TransferCorrupt, TransferRejected, new_payload_digest
from transport.sealed import BadMac, Malformed, SealedCodec, TooLarge, UnpackLimits

PROTOCOL_VERSION = 2  # 2: the MAC covers DOMAIN + header
DOMAIN = b"pdc-kv-header\0"

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
        self.limits = limits or WireLimits()
        lim = self.limits
        self._sealed = SealedCodec(key, DOMAIN, UnpackLimits(
            max_bytes=lim.max_header_bytes, max_str_len=lim.max_str_len,
            max_array_len=lim.max_array_len, max_map_len=lim.max_map_len))

    def __repr__(self) -> str:  # never show the key
        return f"WireCodec(limits={self.limits})"

    def seal(self, header: Header) -> list[bytes]:
        # Not dataclasses.asdict: its recursive deep copy cost ~40 us of a ~60 us send.
        return self._sealed.seal({name: getattr(header, name) for name in _FIELD_TYPES})

    def open(self, blob: bytes, mac: bytes) -> Header:
        """Verify, then parse. Raises TransferAuthError, TransferRejected or TransferCorrupt."""
        try:
            raw = self._sealed.open(blob, mac)
        except TooLarge as exc:
            raise TransferRejected(f"header: {exc}", "bounds") from None
        except BadMac:
            raise TransferAuthError("header MAC does not verify", "bad_mac") from None
        except Malformed as exc:
            raise TransferCorrupt(f"header: {exc}", "malformed") from None
        transfer_id = raw.get("transfer_id") if isinstance(raw.get("transfer_id"), str) else ""
        if raw.get("version") != PROTOCOL_VERSION:
            raise TransferRejected(
                f"protocol version {raw.get('version')!r}, expected {PROTOCOL_VERSION}",
                "version", transfer_id)
        return _to_header(raw, transfer_id)


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
