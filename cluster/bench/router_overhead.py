"""What the router adds to TTFT: the same request sent over HTTP to the Router ingress,
and straight to the decode replica, both through a Serve handle (how a Ray program
calls a deployment) and over the worker stream (how the router itself calls it).

Each path is timed by its natural client: the HTTP requests by a plain client process
(no Ray in it, as a user's), the direct calls by this process (a Ray driver). The
paths take turns, one request at a time, each with its own random prompt (no prefix-
cache hit on any path), so the difference of two p50s is the cost of the HTTP hop,
tokenisation-free routing and SSE framing, plus the router's own call to the replica
where the direct path calls it differently. (An HTTP client inside the driver shares it
with Serve's handle threads and measured ~1 ms slower.)"""

from __future__ import annotations

import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx


def _prompt(rng: random.Random, prompt_len: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(prompt_len)]


def http_ttft_s(http: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> float:
    # `return_token_ids`: every token gets an event, so this times the first token, as the
    # handle path does. Without it a first token that is an incomplete UTF-8 sequence (the
    # byte-level test model samples one about half the time) has no text and no event, and
    # the client would wait one more decode step for the first text.
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    start = time.perf_counter()
    ttft = None
    with http.stream("POST", f"{url}/v1/completions", json=body, headers={"x-pd-mode": "local"}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if ttft is None and line.startswith("data:") and line[5:].strip() != "[DONE]":
                choices = json.loads(line[5:]).get("choices") or [{}]
                if choices[0].get("text") or choices[0].get("token_ids"):
                    ttft = time.perf_counter() - start
    if ttft is None:
        raise RuntimeError("no content chunk over HTTP")
    return ttft


def _direct_request(prompt: list[int], max_tokens: int):
    from workers.engine.sampling_params import SamplingParams
    from workers.protocol import GenerateRequest

    return GenerateRequest(request_id=f"overhead-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           seed=0, route="local", reason="forced")


class FirstToken:
    """Times a direct call's first content chunk: start it, `see` every chunk, `ttft_s`."""

    def __init__(self, path: str) -> None:
        self.path, self.start, self.ttft = path, time.perf_counter(), None

    def see(self, chunk) -> None:
        if self.ttft is None and (chunk.token_ids or chunk.text):
            self.ttft = time.perf_counter() - self.start
        if chunk.error is not None:
            raise RuntimeError(f"decode replica error: {chunk.error}")

    def ttft_s(self) -> float:
        if self.ttft is None:
            raise RuntimeError(f"no content chunk from the decode replica's {self.path}")
        return self.ttft


def handle_ttft_s(handle, prompt: list[int], max_tokens: int) -> float:
    req = _direct_request(prompt, max_tokens)
    clock = FirstToken("handle")
    for chunk in handle.options(stream=True).generate.remote(req):
        clock.see(chunk)
    return clock.ttft_s()


class HttpClientProcess:
    """`http_ttft_s` in a child Python of its own (`python -m cluster.bench.router_overhead URL`),
    one request per `ttft_s` call over JSON lines on its stdin/stdout. A plain subprocess,
    not multiprocessing: spawn would leave its resource tracker running after the bench."""

    def __init__(self, url: str) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "cluster.bench.router_overhead", url],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      cwd=str(Path(__file__).resolve().parents[1]))

    def ttft_s(self, prompt: list[int], max_tokens: int) -> float:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"HTTP client process exited ({self._proc.poll()})")
        result = json.loads(line)
        if "error" in result:
            raise RuntimeError(f"HTTP client process: {result['error']}")
        return float(result["ttft_s"])

    def close(self) -> None:
        try:
            self._proc.communicate(timeout=10)  # closes stdin: the child's loop ends
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def __enter__(self) -> HttpClientProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _client_main(url: str) -> None:
    with httpx.Client(timeout=60) as http:
        for line in sys.stdin:
            msg = json.loads(line)
            try:
                out = {"ttft_s": http_ttft_s(http, url, msg["prompt"], msg["max_tokens"])}
            except Exception as e:  # noqa: BLE001 - reported to the parent
                out = {"error": f"{type(e).__name__}: {e}"}
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()


def measure(url: str, app_name: str, num_samples: int = 30, prompt_len: int = 64, max_tokens: int = 2,
            num_warmup: int = 3, seed: int = 0, deployment: str = "DecodeWorker") -> dict:
    """p50/p90 TTFT of every path and `router_overhead_ttft_p50_ms` (router p50 minus the
    handle's); with a worker stream, `router_overhead_vs_stream_p50_ms` as well."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app_name)
    rng = random.Random(seed)
    times: dict[str, list[float]] = {}
    with httpx.Client(timeout=60) as http, HttpClientProcess(url) as client, \
            DirectStream.open(app_name) as stream:
        paths = {"router": lambda: client.ttft_s(_prompt(rng, prompt_len), max_tokens),
                 "direct": lambda: handle_ttft_s(handle, _prompt(rng, prompt_len), max_tokens)}
        if stream is not None:
            paths["stream"] = lambda: stream.ttft_s(_prompt(rng, prompt_len), max_tokens)
        for i in range(num_warmup + num_samples):
            if i == num_warmup:
                before = router_ttft_sum_count(http, url)
            order = list(paths)[i % len(paths):] + list(paths)[:i % len(paths)]  # rotate who goes first
            for name in order:
                value = paths[name]()
                if i >= num_warmup:
                    times.setdefault(name, []).append(value)
                time.sleep(0.05)
        after = router_ttft_sum_count(http, url)
    return _summary(times, num_samples, prompt_len, max_tokens, _mean_ms(before, after))


def _summary(times: dict[str, list[float]], num_samples: int, prompt_len: int, max_tokens: int,
             router_side_mean_ms: float | None) -> dict:
    p50 = {name: _ms(statistics.median(values)) for name, values in times.items()}
    out = {"num_samples": num_samples, "prompt_len": prompt_len, "max_tokens": max_tokens,
           "router_ttft_p50_ms": p50["router"], "direct_ttft_p50_ms": p50["direct"],
           "router_ttft_p90_ms": _ms(_p90(times["router"])), "direct_ttft_p90_ms": _ms(_p90(times["direct"])),
           # the router's own TTFT (its arrival -> first chunk; mean, from /metrics): the
           # rest of the client's TTFT is the HTTP proxy and the client's own HTTP
           "router_side_ttft_mean_ms": router_side_mean_ms,
           "router_overhead_ttft_p50_ms": round(p50["router"] - p50["direct"], 3),
           # the same, from back-to-back pairs (less sensitive to the machine's drift)
           "router_overhead_paired_p50_ms": _paired_ms(times["router"], times["direct"])}
    if "stream" in times:  # the decode replica called the way the router calls it
        out.update(direct_stream_ttft_p50_ms=p50["stream"],
                   direct_stream_ttft_p90_ms=_ms(_p90(times["stream"])),
                   router_overhead_vs_stream_p50_ms=round(p50["router"] - p50["stream"], 3),
                   router_overhead_vs_stream_paired_p50_ms=_paired_ms(times["router"], times["stream"]))
    return out


def _paired_ms(a: list[float], b: list[float]) -> float:
    return _ms(statistics.median(x - y for x, y in zip(a, b, strict=True)))


class DirectStream:
    """The decode replica's worker stream, called from this (synchronous) driver through
    an event loop on a thread of its own; `open` yields None when the app has no stream
    or this process lacks the transport key."""

    def __init__(self, address: str, codec) -> None:
        import asyncio
        import threading

        from workers.stream.client import WorkerStreams

        self.address = address
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="direct-stream", daemon=True)
        self.thread.start()
        self.streams = WorkerStreams(codec)

    @classmethod
    @contextlib.contextmanager
    def open(cls, app_name: str):
        address, key = _stream_address(app_name), os.environ.get("PDC_TRANSPORT_KEY")
        if not address or not key:
            yield None
            return
        from workers.stream.wire import StreamCodec

        direct = cls(address, StreamCodec(key))
        try:
            yield direct
        finally:
            direct.close()

    def ttft_s(self, prompt: list[int], max_tokens: int) -> float:
        import asyncio

        return asyncio.run_coroutine_threadsafe(self._ttft_s(prompt, max_tokens), self.loop).result(60)

    async def _ttft_s(self, prompt: list[int], max_tokens: int) -> float:
        req = _direct_request(prompt, max_tokens)
        clock = FirstToken("stream")
        async for chunk in self.streams.call(self.address, req):
            clock.see(chunk)
        return clock.ttft_s()

    def close(self) -> None:
        import asyncio

        async def stop() -> None:
            self.streams.close()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def _stream_address(app_name: str) -> str | None:
    """The decode replica's advertised worker-stream address, from the app's ControlPlane."""
    from ray import serve

    try:
        control_plane = serve.get_deployment_handle("ControlPlane", app_name=app_name)
        state = control_plane.get_state.remote(0).result(timeout_s=30)
    except Exception:  # noqa: BLE001 - an app without one (the echo deployment)
        return None
    return next((r.extra.get("stream_address") for r in state.replicas
                 if r.role == "decode" and r.extra.get("stream_address")), None)


def router_ttft_sum_count(http: httpx.Client, url: str) -> tuple[float, float]:
    """The router's TTFT histogram, summed over its label sets: (sum s, count)."""
    total, count = 0.0, 0.0
    for line in http.get(f"{url}/metrics").text.splitlines():
        name, value = line.partition("{")[0].partition(" ")[0], line.rsplit(" ", 1)[-1]
        if name == "pdc_time_to_first_token_seconds_sum":
            total += float(value)
        elif name == "pdc_time_to_first_token_seconds_count":
            count += float(value)
    return total, count


def _mean_ms(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    n = after[1] - before[1]
    return round((after[0] - before[0]) / n * 1000.0, 3) if n > 0 else None


def _p90(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.9 * len(values)))]


def _ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


if __name__ == "__main__":
    _client_main(sys.argv[1])

