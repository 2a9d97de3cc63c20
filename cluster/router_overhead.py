"""What the router adds to TTFT: the same request sent over HTTP to the Router ingress,
and straight to the decode deployment through a Serve handle.

Each path is timed by its natural client: the HTTP requests by a plain client process
(no Ray in it, as a user's), the handle calls by this process (a Ray driver). The two
take turns, one request at a time, each with its own random prompt (no prefix-cache
hit on either path), so the difference of the two p50s is the cost of the HTTP hop,
tokenisation-free routing and SSE framing. (An HTTP client inside the driver shares it
with Serve's handle threads and measured ~1 ms slower.)"""

from __future__ import annotations

import json
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


def handle_ttft_s(handle, prompt: list[int], max_tokens: int) -> float:
    from workers.engine.sampling_params import SamplingParams
    from workers.protocol import GenerateRequest

    req = GenerateRequest(request_id=f"overhead-{uuid.uuid4().hex[:8]}", prompt_token_ids=prompt,
                          params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                          seed=0, route="local", reason="forced")
    start = time.perf_counter()
    ttft = None
    for chunk in handle.options(stream=True).generate.remote(req):
        if ttft is None and (chunk.token_ids or chunk.text):
            ttft = time.perf_counter() - start
        if chunk.error is not None:
            raise RuntimeError(f"decode replica error: {chunk.error}")
    if ttft is None:
        raise RuntimeError("no content chunk from the decode handle")
    return ttft


class HttpClientProcess:
    """`http_ttft_s` in a child Python of its own (`python -m cluster.router_overhead URL`),
    one request per `ttft_s` call over JSON lines on its stdin/stdout. A plain subprocess,
    not multiprocessing: spawn would leave its resource tracker running after the bench."""

    def __init__(self, url: str) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "cluster.router_overhead", url],
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
    """p50/p90 TTFT of both paths and `router_overhead_ttft_p50_ms` (their p50 difference)."""
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=app_name)
    rng = random.Random(seed)
    via_router, direct, pairs = [], [], []
    with httpx.Client(timeout=60) as http, HttpClientProcess(url) as client:
        for i in range(num_warmup + num_samples):
            if i == num_warmup:
                before = router_ttft_sum_count(http, url)
            pair = [("router", lambda: client.ttft_s(_prompt(rng, prompt_len), max_tokens)),
                    ("direct", lambda: handle_ttft_s(handle, _prompt(rng, prompt_len), max_tokens))]
            values = {}
            for name, call in pair if i % 2 else reversed(pair):
                values[name] = call()
                time.sleep(0.05)
            if i >= num_warmup:
                via_router.append(values["router"])
                direct.append(values["direct"])
                pairs.append(values["router"] - values["direct"])
        after = router_ttft_sum_count(http, url)
    router_p50, direct_p50 = _ms(statistics.median(via_router)), _ms(statistics.median(direct))
    return {"num_samples": num_samples, "prompt_len": prompt_len, "max_tokens": max_tokens,
            "router_ttft_p50_ms": router_p50, "direct_ttft_p50_ms": direct_p50,
            "router_ttft_p90_ms": _ms(_p90(via_router)), "direct_ttft_p90_ms": _ms(_p90(direct)),
            # the router's own TTFT (its arrival -> first chunk; mean, from /metrics): the
            # rest of the client's TTFT is the HTTP proxy and the client's own HTTP
            "router_side_ttft_mean_ms": _mean_ms(before, after),
            "router_overhead_ttft_p50_ms": round(router_p50 - direct_p50, 3),
            # the same, from back-to-back pairs (less sensitive to the machine's drift)
            "router_overhead_paired_p50_ms": _ms(statistics.median(pairs))}


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

