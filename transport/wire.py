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
from workers.engine.kv_types import FirstToken
from workers.engine.sampling_params import MAX_LOGPROBS
from workers.engine.sequence import TokenLogprob

PROTOCOL_VERSION = 2  # 2: the MAC covers DOMAIN + header
MAX_SIBLINGS = 1024  # first tokens of a request's other sequences (n - 1) in one DONE
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
    # DONE, when the request asked for logprobs: the first token's logprob under the raw
    # logits and its top alternatives (ids and logprobs, most likely first).
    first_logprob: float | None = None
    first_top_ids: list[int] = field(default_factory=list)
    first_top_logprobs: list[float] = field(default_factory=list)
    # DONE, when the request has n > 1: the first tokens of its sequences 1, 2, ..., and
    # (with logprobs) their logprobs; their top alternatives are the first token's (same logits).
    sibling_token_ids: list[int] = field(default_factory=list)
    sibling_logprobs: list[float] = field(default_factory=list)
    error: str = ""  # NACK/ABORT: TransferError.kind
    reason: str = ""  # NACK/ABORT: finer cause
    detail: str = ""  # NACK/ABORT: human-readable message
    extra: dict[str, str | int] = field(default_factory=dict)  # data-path specifics
    version: int = PROTOCOL_VERSION


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    f.name: {"int": int, "str": str, "list[int]": list, "list[float]": list,
             "float | None": (float, type(None)), "dict[str, str | int]": dict}[str(f.type)]
    for f in fields(Header)
}


@dataclass(frozen=True)
class WireLimits:
    """Receiver-side bounds on what the parser will allocate for a header."""

    max_header_bytes: int = 16 << 10
    max_str_len: int = 4096
    max_array_len: int = 32  # shape has 5-6 dims; a token's top alternatives at most 20
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
          and header.nbytes >= 0 and header.seq >= 0 and _first_logprob_ok(header))
    if not ok:
        raise TransferCorrupt("header values out of range", "malformed", transfer_id)
    return header


def _first_logprob_ok(header: Header) -> bool:
    ids, logprobs = header.first_top_ids, header.first_top_logprobs
    return (len(ids) == len(logprobs) <= MAX_LOGPROBS
            and (header.first_logprob is not None or not ids)
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            and all(isinstance(lp, float) for lp in logprobs)
            and len(header.sibling_token_ids) <= MAX_SIBLINGS
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in header.sibling_token_ids)
            and len(header.sibling_logprobs) in (0, len(header.sibling_token_ids))
            and (header.first_logprob is not None or not header.sibling_logprobs)
            and all(isinstance(lp, float) for lp in header.sibling_logprobs))


def first_token(header: Header) -> FirstToken:
    """The first token a DONE header carries, with its logprob if it has one, and its siblings'."""
    if header.first_logprob is None:
        return FirstToken(header.first_token_id, siblings=tuple(FirstToken(t) for t in header.sibling_token_ids))
    top = tuple(zip(header.first_top_ids, header.first_top_logprobs, strict=True))
    siblings = tuple(FirstToken(t, TokenLogprob(t, lp, top))
                     for t, lp in zip(header.sibling_token_ids, header.sibling_logprobs, strict=True))
    return FirstToken(header.first_token_id, TokenLogprob(header.first_token_id, header.first_logprob, top), siblings)


def done_header(transfer_id: str, seq: int, first_token_id: int, logprob: TokenLogprob | None,
                siblings: tuple[FirstToken, ...] = ()) -> Header:
    """The DONE message of a transfer: its first token and that token's logprob (and its
    siblings', with n > 1), as plain numbers."""
    top = logprob.top[:MAX_LOGPROBS] if logprob is not None else ()
    return Header(DONE, transfer_id, seq, first_token_id=int(first_token_id),
                  first_logprob=None if logprob is None else float(logprob.logprob),
                  first_top_ids=[int(t) for t, _ in top], first_top_logprobs=[float(lp) for _, lp in top],
                  sibling_token_ids=[int(s.token_id) for s in siblings],
                  sibling_logprobs=[] if logprob is None else [float(s.logprob.logprob) for s in siblings])
