"""One request over httpx, timed chunk by chunk.

Timing rules (INTERFACES.md): the clock starts just before the request is sent; TTFT
stops at the first chunk carrying generated text or token ids (a role-only chat chunk does
not count); every later content chunk adds one ITL gap; E2E stops at the last content chunk.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import asdict, dataclass, field

import httpx

from cluster.loadtest.prompt_blocks import prompt_block_hashes
from cluster.loadtest.workloads import RequestSpec


@dataclass(frozen=True)
class Caps:
    """What the server accepts, found by `probe` before the run."""

    token_ids: bool = False  # `prompt` as a list of ids on /v1/completions
    extensions: bool = False  # `ignore_eos` and `min_tokens`


@dataclass(frozen=True)
class Target:
    url: str
    endpoint: str  # "completions" | "chat"
    model: str | None
    headers: dict[str, str]
    stream: bool = True
    timeout_s: float = 300.0
    run_id: str = ""  # prefixes x-request-id so ids stay unique across runs on one server

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


@dataclass
class RequestRecord:
    """What one request did. Times are seconds from the run's start (`*_at_s`) or spans."""

    index: int
    request_id: str
    workload: str
    scheduled_at_s: float | None  # open loop: when it should have gone
    sent_at_s: float = 0.0
    ended_at_s: float = 0.0  # last byte, or the failure
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_chunks: int = 0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    target_prompt_len: int = 0
    target_output_len: int = 0
    status: int | None = None
    route: str | None = None
    reason: str | None = None
    predicted_ttft_s: float | None = None  # the router's x-pd-predicted-*-ms for the route taken
    predicted_tpot_s: float | None = None
    error_kind: str | None = None
    error: str | None = None
    client_id: int = 0
    prompt_block_hashes: list[str] = field(default_factory=list)  # of the prompt's bytes, never its text

    @property
    def ok(self) -> bool:
        return self.error_kind is None

    @property
    def output_tokens(self) -> int:
        """Server-reported count; the number of content chunks if it reported none."""
        return self.completion_tokens if self.completion_tokens is not None else self.num_chunks

    @property
    def tpot_s(self) -> float | None:
        n = self.output_tokens
        if not self.ok or self.ttft_s is None or self.e2e_s is None or n < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (n - 1)

    def to_json(self) -> dict:
        row = asdict(self)
        row["ok"] = self.ok
        row["tpot_s"] = self.tpot_s
        return row

    @classmethod
    def from_json(cls, row: dict) -> RequestRecord:
        return cls(**{k: v for k, v in row.items() if k in cls.__dataclass_fields__})


def build_body(spec: RequestSpec, target: Target, caps: Caps) -> dict:
    body: dict = {"max_tokens": spec.output_len, "stream": target.stream, "temperature": 0.0}
    if target.model:
        body["model"] = target.model
    if target.stream:
        body["stream_options"] = {"include_usage": True}
    if caps.extensions:
        body["ignore_eos"] = True
        body["min_tokens"] = spec.output_len
    if target.endpoint == "chat":
        body["messages"] = list(spec.messages)
    else:
        body["prompt"] = spec.prompt_ids if caps.token_ids else spec.prompt
    return body


def _content_of(choice: dict) -> bool:
    """Whether a choice carries generated output (text or token ids), not just a role."""
    if choice.get("token_ids"):
        return True
    if "delta" in choice:
        delta = choice["delta"] or {}
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("token_ids"))
    return bool(choice.get("text"))


class _Timer:
    """Turns content-chunk arrival times into TTFT, ITL gaps and E2E on `record`."""

    def __init__(self, record: RequestRecord, start: float) -> None:
        self.record, self.start, self.last = record, start, None

    def content(self, now: float) -> None:
        r = self.record
        if self.last is None:
            r.ttft_s = now - self.start
        else:
            r.itl_s.append(now - self.last)
        self.last = now
        r.num_chunks += 1
        r.e2e_s = now - self.start


async def send_request(
    http: httpx.AsyncClient, target: Target, caps: Caps, spec: RequestSpec, record: RequestRecord,
    base: float,
) -> RequestRecord:
    """Send `spec`, filling `record` (also returned). Never raises for server errors."""
    record.target_prompt_len, record.target_output_len = spec.prompt_len, spec.output_len
    record.prompt_block_hashes = prompt_block_hashes(spec.prompt)
    headers = {"x-workload": spec.workload, **target.headers, "x-request-id": f"{target.run_id}{spec.request_id}"}
    record.workload = headers["x-workload"]  # the profile the server was asked for (a --header may override)
    body = build_body(spec, target, caps)
    start = time.perf_counter()
    record.sent_at_s = start - base
    try:
        await asyncio.wait_for(_exchange(http, target, headers, body, record, start), target.timeout_s)
    except asyncio.TimeoutError:
        _fail(record, "timeout", f"no complete response in {target.timeout_s:g}s")
    except httpx.TimeoutException as e:
        _fail(record, "timeout", repr(e))
    except httpx.ConnectError as e:
        _fail(record, "connect_error", repr(e))
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        _fail(record, "connection_lost", repr(e))
    except httpx.HTTPError as e:
        _fail(record, "http_error", repr(e))
    except json.JSONDecodeError as e:
        _fail(record, "bad_response", f"unparseable JSON: {e}")
    if record.ok and record.num_chunks == 0:
        _fail(record, "empty_response", "no generated text or tokens")
    record.ended_at_s = time.perf_counter() - base
    return record


def _fail(record: RequestRecord, kind: str, message: str) -> None:
    if record.error_kind is None:
        record.error_kind, record.error = kind, message[:500]


async def _exchange(http, target: Target, headers: dict, body: dict, record: RequestRecord, start: float) -> None:
    timer = _Timer(record, start)
    async with http.stream("POST", target.url + target.path, json=body, headers=headers) as resp:
        record.status = resp.status_code
        record.route = resp.headers.get("x-pd-route")
        record.reason = resp.headers.get("x-pd-reason")
        record.predicted_ttft_s = _header_ms_as_s(resp.headers, "x-pd-predicted-ttft-ms")
        record.predicted_tpot_s = _header_ms_as_s(resp.headers, "x-pd-predicted-tpot-ms")
        if resp.status_code != 200:
            text = (await resp.aread()).decode("utf-8", "replace")
            _fail(record, f"http_{resp.status_code}", _error_message(text))
            return
        if target.stream:
            await _read_stream(resp, record, timer)
        else:
            payload = json.loads(await resp.aread())
            _take_payload(payload, record, timer, time.perf_counter())


async def _read_stream(resp: httpx.Response, record: RequestRecord, timer: _Timer) -> None:
    """Stamp each SSE `data:` line with the time its bytes arrived; parse the JSON only
    after the stream ends, so the hot loop stays cheap when thousands of chunks a second
    share one event loop with the schedule."""
    events: list[tuple[float, bytes]] = []
    pending = b""
    async for data in resp.aiter_bytes():
        now = time.perf_counter()
        *lines, pending = (pending + data).split(b"\n")
        events.extend((now, line[5:].strip()) for line in lines if line.startswith(b"data:"))
    if pending.startswith(b"data:"):
        events.append((time.perf_counter(), pending[5:].strip()))
    done = False
    for now, payload in events:
        if payload == b"[DONE]":
            done = True
            break
        _take_payload(json.loads(payload), record, timer, now)
    if not done and record.ok:
        _fail(record, "incomplete_stream", "stream ended without [DONE]")


def _take_payload(payload: dict, record: RequestRecord, timer: _Timer, now: float) -> None:
    if "error" in payload:
        error = payload["error"] or {}
        _fail(record, "stream_error", str(error.get("message", error)))
        return
    if any(_content_of(c) for c in payload.get("choices") or ()):
        timer.content(now)
    usage = payload.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")


def _header_ms_as_s(headers: httpx.Headers, name: str) -> float | None:
    """A decimal-milliseconds header in seconds; None when absent, unparseable or not finite
    (an older server, an error answer)."""
    try:
        value = float(headers.get(name, ""))
    except ValueError:
        return None
    return value / 1000.0 if math.isfinite(value) else None


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:300]


async def probe(http: httpx.AsyncClient, target: Target, prompt_format: str) -> Caps:
    """Find the richest request form the server accepts, with one-token requests: token
    ids + extensions, then text + extensions, then plain text. `prompt_format` ids|text
    skips the token-id question. Raises if the server accepts none of them."""
    wants_ids = target.endpoint == "completions" and prompt_format in ("auto", "ids")
    candidates = [Caps(True, True), Caps(True, False)] if wants_ids else []
    if prompt_format != "ids" or target.endpoint == "chat":
        candidates += [Caps(False, True), Caps(False, False)]
    spec = RequestSpec("probe", "probe", ({"role": "user", "content": "hello there"},), 2)
    probe_target = Target(target.url, target.endpoint, target.model, target.headers, False, min(target.timeout_s, 120.0))
    last = ""
    for caps in candidates:
        try:
            resp = await http.post(probe_target.url + probe_target.path, json=build_body(spec, probe_target, caps),
                                   headers={**target.headers, "x-request-id": "loadtest-probe"},
                                   timeout=probe_target.timeout_s)
        except httpx.HTTPError as e:
            raise RuntimeError(f"cannot reach {target.url}: {e!r}") from None
        if resp.status_code == 200:
            return caps
        last = f"HTTP {resp.status_code}: {_error_message(resp.text)}"
        if resp.status_code not in (400, 422):
            break
    raise RuntimeError(f"{target.url}{target.path} rejected the probe request ({last})")


async def fetch_models(http: httpx.AsyncClient, url: str, headers: dict) -> dict | None:
    try:
        resp = await http.get(url + "/v1/models", headers=headers, timeout=10)
        return resp.json() if resp.status_code == 200 else {"status": resp.status_code}
    except (httpx.HTTPError, ValueError) as e:
        return {"error": repr(e)}


def make_http_client(max_connections: int | None = None, verify=True) -> httpx.AsyncClient:
    """One pooled client; no connection cap (an open loop must never queue behind a pool)."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=30.0), verify=verify)


class ClientShards:
    """Several httpx clients, request i on shard i % n. httpcore's pool rescans every
    connection on each request and response (quadratic in requests in flight); small pools
    keep a 100 req/s run from spending its CPU there. One TLS context serves all shards."""

    def __init__(self, num_shards: int = 16) -> None:
        import ssl

        try:
            import certifi

            context = ssl.create_default_context(cafile=certifi.where())
        except ImportError:
            context = ssl.create_default_context()
        self.clients = [make_http_client(verify=context) for _ in range(num_shards)]

    def pick(self, index: int) -> httpx.AsyncClient:
        return self.clients[index % len(self.clients)]

    async def __aenter__(self) -> ClientShards:
        return self

    async def __aexit__(self, *exc) -> None:
        for client in self.clients:
            await client.aclose()
