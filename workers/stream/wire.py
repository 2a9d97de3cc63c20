"""The worker stream's messages: msgpack maps sealed with HMAC-SHA256.

The router calls a worker replica's `generate` over ZeroMQ (workers/stream/client.py ->
workers/stream/server.py) instead of a Serve handle, because every handle hop costs a few
milliseconds on the TTFT path and again on every token. A message is the frames
`[body, mac]`, sealed (transport/sealed.py) with the cluster's transport key
(resolved once by the app builder) under the stream's own domain tag, which keeps a stream message from
ever verifying as a KV-transport header and the other way round. The MAC is checked before
anything is parsed, the parser has hard size limits, and nothing on the wire is unpickled.

Replays: every message from a router carries its session (random per router process),
a sequence number that only grows and its send time; a worker refuses a message stamped
outside `CLOCK_WINDOW_S` or not newer than the last one of its session (sessions are
forgotten only once their messages would be refused by time anyway). Replies carry the
call id (random 63-bit) and the chunk's index within the call, which the router checks.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from transport.sealed import BadMac, SealedCodec, SealError, UnpackLimits
from transport.transfer_record import TransferRecord
from workers.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from workers.engine.sequence import TokenLogprob
from workers.engine.step_cost import StepRecord
from workers.protocol import (
    REASONS,
    GenerateChunk,
    GenerateRequest,
    PrefillRequest,
    PrefillResult,
    StepsReply,
    StepsRequest,
)

DOMAIN = b"pdc-worker-stream-v1\0"
CLOCK_WINDOW_S = 60.0  # tolerated clock skew between a router and a worker, and replay horizon

# Router -> worker: OPEN (start a call), CANCEL (abort it), PING (liveness, both ways).
# Worker -> router: CHUNK (one GenerateChunk of a call), END (the call is over), PONG.
OPEN, CANCEL, PING, CHUNK, END, PONG = "open", "cancel", "ping", "chunk", "end", "pong"
KINDS = frozenset((OPEN, CANCEL, PING, CHUNK, END, PONG))
DRAINING = "draining"  # END.error of a call refused by a replica that is shutting down


class StreamAuthError(Exception):
    """The MAC did not verify: not from a peer holding the key."""


class StreamRejected(Exception):
    """Authentic but unacceptable: malformed, too large, stale or replayed."""


@dataclasses.dataclass(frozen=True)
class StreamLimits:
    max_body_bytes: int = 64 << 20  # a prompt of a few million token ids
    max_array_len: int = 1 << 23  # prompt token ids
    max_str_len: int = 1 << 20  # text chunk, error message, stop string
    max_map_len: int = 64


class StreamCodec:
    def __init__(self, key: str | bytes, limits: StreamLimits | None = None) -> None:
        self.limits = limits or StreamLimits()
        lim = self.limits
        self._sealed = SealedCodec(key.encode() if isinstance(key, str) else key, DOMAIN, UnpackLimits(
            max_bytes=lim.max_body_bytes, max_str_len=lim.max_str_len,
            max_array_len=lim.max_array_len, max_map_len=lim.max_map_len))

    def __repr__(self) -> str:  # never show the key
        return f"StreamCodec(limits={self.limits})"

    def seal(self, message: dict[str, Any]) -> list[bytes]:
        return self._sealed.seal(message)

    def open(self, frames: list[bytes]) -> dict[str, Any]:
        """Verify, then parse. Raises StreamAuthError or StreamRejected."""
        if len(frames) != 2:
            raise StreamRejected(f"expected 2 frames, got {len(frames)}")
        try:
            msg = self._sealed.open(*frames)
        except BadMac:
            raise StreamAuthError("message MAC does not verify") from None
        except SealError as exc:
            raise StreamRejected(f"message: {exc}") from None
        if msg.get("t") not in KINDS:
            raise StreamRejected("not a stream message")
        return msg


class ReplayGuard:
    """Per router session: the last sequence number seen, kept as long as a replay of it
    could still pass the clock check."""

    def __init__(self, window_s: float = CLOCK_WINDOW_S, clock=time.time) -> None:
        self.window_s = window_s
        self.clock = clock
        self._last: dict[str, tuple[int, float]] = {}  # session -> (seq, when seen)

    def check(self, msg: dict[str, Any]) -> None:
        session, seq, sent = msg.get("s"), msg.get("n"), msg.get("ts")
        if not isinstance(session, str) or not isinstance(seq, int) or not isinstance(sent, (int, float)):
            raise StreamRejected("message without session, sequence or time")
        now = self.clock()
        if abs(now - sent) > self.window_s:
            raise StreamRejected("message stamped outside the clock window (replayed or clock skew)")
        last = self._last.get(session)
        if last is not None and seq <= last[0]:
            raise StreamRejected("replayed message")
        self._last[session] = (seq, now)
        if len(self._last) > 1024:
            self._forget(now)

    def _forget(self, now: float) -> None:
        horizon = now - 2 * self.window_s
        self._last = {s: v for s, v in self._last.items() if v[1] >= horizon}


# ---- the calls' requests and replies as plain maps --------------------------------------
# Three methods: "generate" (GenerateRequest -> GenerateChunk, ...) on every worker, from the
# router; "prefill" (PrefillRequest -> one PrefillResult) on prefill workers, from decode;
# "steps" (StepsRequest -> one StepsReply) on every worker, from the router's admin API.

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_LOGPROB_FIELDS = ("logprobs", "prompt_logprobs")  # lists of TokenLogprob | None, on replies


def to_wire(obj: Any) -> dict[str, Any]:
    """A request or reply dataclass as a map (its SamplingParams as a map too)."""
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(out.get("params"), SamplingParams):
        out["params"] = dataclasses.asdict(out["params"])
    for name in _LOGPROB_FIELDS:
        if out.get(name) is not None:
            out[name] = [None if e is None else [e.token_id, e.logprob, [list(t) for t in e.top]]
                         for e in out[name]]
    return out


def _logprobs_from_wire(raw: Any) -> list[TokenLogprob | None] | None:
    """A reply's logprob list back as TokenLogprob entries; raises StreamRejected if malformed."""
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise StreamRejected("logprobs must be a list")
    return [None if entry is None else _logprob_from_wire(entry) for entry in raw]


def _logprob_from_wire(entry: Any) -> TokenLogprob:
    if not (isinstance(entry, (list, tuple)) and len(entry) == 3 and isinstance(entry[2], (list, tuple))
            and len(entry[2]) <= MAX_LOGPROBS + 1):
        raise StreamRejected("a logprob entry must be [token id, logprob, [[id, logprob], ...]]")
    token_id, logprob = _token_and_logprob(entry[:2])
    return TokenLogprob(token_id, logprob, tuple(_token_and_logprob(pair) for pair in entry[2]))


def _token_and_logprob(pair: Any) -> tuple[int, float]:
    if not (isinstance(pair, (list, tuple)) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0
            and type(pair[1]) in (int, float)):
        raise StreamRejected("a logprob must be a token id >= 0 and a number")
    return pair[0], float(pair[1])


def request_from_wire(raw: Any) -> GenerateRequest:
    """Raises StreamRejected naming what is wrong."""
    _same_fields(raw, GenerateRequest)
    _expect(raw, request_id=str, seed=int, route=str, reason=str, workload=str,
            prefill_timeout_s=(int, float))
    _expect_optional(raw, deadline=(int, float), target_replica=str, prefill_replica=str,
                     prefill_address=str)
    if raw["route"] not in ("local", "disagg") or raw["reason"] not in REASONS:
        raise StreamRejected("unknown route or reason")
    return GenerateRequest(**_with_prompt_and_params(raw))


def prefill_request_from_wire(raw: Any) -> PrefillRequest:
    _same_fields(raw, PrefillRequest)
    _expect(raw, request_id=str, transfer_id=str, seed=int, decode_address=str, start_block=int,
            layout_fingerprint=str, timeout_s=(int, float))
    _expect_optional(raw, deadline=(int, float), target_replica=str)
    return PrefillRequest(**_with_prompt_and_params(raw))


def chunk_from_wire(raw: Any) -> GenerateChunk:
    chunk = _reply(raw, GenerateChunk)
    if type(chunk.index) is not int or chunk.index < 0:
        raise StreamRejected("chunk index must be a non-negative integer")
    for name in ("worker_ttft_s", "transfer_tail_s"):
        if not _seconds_or_none(getattr(chunk, name)):
            raise StreamRejected(f"{name} must be a non-negative number of seconds")
    return chunk


def _seconds_or_none(value: Any) -> bool:
    return value is None or (type(value) in (int, float) and 0 <= value < math.inf)


def prefill_result_from_wire(raw: Any) -> PrefillResult:
    result = _reply(raw, PrefillResult)
    if not all(type(getattr(result, n)) is int for n in ("num_cached_tokens", "num_bytes")):
        raise StreamRejected("prefill result has the wrong types")
    if not _seconds_or_none(result.tail_s):
        raise StreamRejected("tail_s must be a non-negative number of seconds")
    return result


def steps_request_from_wire(raw: Any) -> StepsRequest:
    _same_fields(raw, StepsRequest)
    _expect(raw, since=(int, float), limit=int)
    if raw["limit"] < 0:
        raise StreamRejected("limit must be >= 0")
    return StepsRequest(**raw)


def steps_reply_from_wire(raw: Any) -> StepsReply:
    _same_fields(raw, StepsReply)
    if not isinstance(raw["role"], str):
        raise StreamRejected("role must be a string")
    return StepsReply(raw["role"], _records(raw["steps"], StepRecord), _records(raw["transfers"], TransferRecord))


def _records(raw: Any, kind: type) -> list[dict]:
    """A list of `kind`'s fields as maps: numbers, and strings where `kind` has them."""
    if not isinstance(raw, list):
        raise StreamRejected(f"{kind.__name__} records must be a list")
    for record in raw:
        _same_fields(record, kind)
        if not all(type(v) in (int, float, str) for v in record.values()):
            raise StreamRejected(f"{kind.__name__} fields must be numbers or strings")
    return raw


REQUESTS = {"generate": request_from_wire, "prefill": prefill_request_from_wire, "steps": steps_request_from_wire}
REPLIES = {"generate": chunk_from_wire, "prefill": prefill_result_from_wire, "steps": steps_reply_from_wire}


def _same_fields(raw: Any, kind: type) -> None:
    if not isinstance(raw, dict) or set(raw) != {f.name for f in dataclasses.fields(kind)}:
        raise StreamRejected(f"{kind.__name__} fields do not match")


def _with_prompt_and_params(raw: dict) -> dict:
    ids = raw["prompt_token_ids"]
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise StreamRejected("prompt_token_ids must be non-negative integers")
    params = raw.get("params")
    if not isinstance(params, dict) or not set(params) <= set(_PARAM_FIELDS):
        raise StreamRejected("sampling params fields do not match")
    bias, guided = params.get("logit_bias") or [], params.get("guided")
    if not isinstance(bias, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and type(p[0]) is int and type(p[1]) in (int, float)
            for p in bias):
        raise StreamRejected("logit_bias must be [token id, bias] pairs")
    if guided is not None and not (isinstance(guided, dict) and all(isinstance(v, str) for v in guided.values())):
        raise StreamRejected("guided must be a map of strings")
    try:
        return {**raw, "params": SamplingParams(**params)}
    except (TypeError, ValueError) as exc:
        raise StreamRejected(f"sampling params: {exc}") from None


def _reply(raw: Any, kind: type):
    if not isinstance(raw, dict) or not set(raw) <= {f.name for f in dataclasses.fields(kind)}:
        raise StreamRejected(f"{kind.__name__} fields do not match")
    raw = {**raw, **{n: _logprobs_from_wire(raw[n]) for n in _LOGPROB_FIELDS if n in raw}}
    try:
        return kind(**raw)
    except TypeError as exc:
        raise StreamRejected(f"{kind.__name__}: {exc}") from None


def _expect(raw: dict, **types) -> None:
    for name, kind in types.items():
        value = raw.get(name)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise StreamRejected(f"request field {name} has the wrong type")


def _expect_optional(raw: dict, **types) -> None:
    _expect({k: raw[k] for k in types if raw.get(k) is not None}, **{k: t for k, t in types.items()
                                                                    if raw.get(k) is not None})
