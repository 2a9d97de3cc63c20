"""The cluster benchmark's three workloads, sized to the machine they run on.

A fixed request rate means "high load" on one machine and an idle cluster (or a
meltdown) on another, and a fixed SLO is either trivial or impossible. So, as DistServe
does, the benchmark first measures one request alone on one replica (`Baseline`), then
states every rate as a fraction of a replica's capacity and every SLO as a multiple
(`SLO_SCALE`) of that unloaded latency. The realized numbers go into the JSON report.

- `short_low_load`: short prompts, about one request in flight on average (two replicas).
- `long_high_load`: long prompts at 55% of what two replicas can prefill alone, i.e. 110%
  of one prefill replica: always-disaggregate queues, colocated prefills beside its
  streams, `auto` must decide when to spill prompts to the decode replica. (Two engines
  on two cores run slower together than one alone, and the router, proxy and client need
  CPU too: 70% overloaded every configuration.)
- `mixed`: the interference workload: about two short-prompt streams decoding while
  four long prompts arrive, evenly spread over the run. Four is what makes the p99 of
  the inter-token gaps see the stalls: each long prompt's prefill stalls every stream on
  its replica once per 512-token chunk, and those stalled gaps must be over 1% of all.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

import httpx

from cluster.loadtest.config import SLO
from cluster.local.traffic import ClusterWorkload, RequestClass

SLO_SCALE = 5.0  # an SLO is this many times the unloaded single-request latency
SHORT_PROMPT = (64, 128)
LONG_PROMPT = (1024, 2048)
LONG_LOAD = 0.55  # long_high_load: offered prefill work over two replicas' prefill capacity
WORKLOAD_NAMES = ("short_low_load", "long_high_load", "mixed")  # what `bench_workloads` returns, in order


@dataclass(frozen=True)
class Baseline:
    """One request alone on one idle replica (medians), in milliseconds."""

    ttft_short_ms: float  # a SHORT_PROMPT-mean prompt
    ttft_long_ms: float  # a LONG_PROMPT-mean prompt
    tpot_ms: float  # per output token of a lone stream

    def e2e_ms(self, output_len: int) -> float:
        return self.ttft_short_ms + (output_len - 1) * self.tpot_ms


def class_slo(b: Baseline, class_name: str, ttft_x: float = SLO_SCALE, tpot_x: float = SLO_SCALE) -> SLO:
    """A request class's SLO as multiples of its unloaded latencies: TTFT of a prompt of
    its length (`long`, else short), TPOT of a lone stream."""
    ttft_ms = b.ttft_long_ms if class_name == "long" else b.ttft_short_ms
    return SLO(ttft_ms=round(ttft_x * ttft_ms, 3), tpot_ms=round(tpot_x * b.tpot_ms, 3))


def bench_workloads(b: Baseline) -> dict[str, ClusterWorkload]:
    short_slo, long_slo = class_slo(b, "short"), class_slo(b, "long")
    long_s, stream_s = b.ttft_long_ms / 1000.0, b.e2e_ms(32) / 1000.0
    num_short_mixed, num_long_mixed = 40, 4
    mixed_span_s = num_short_mixed * stream_s / 2.0  # ~2 streams in flight
    long_interval_s = mixed_span_s / num_long_mixed  # the long prompts spread over the span
    return {
        "short_low_load": ClusterWorkload(
            "short_low_load", "short prompts at low load: disaggregation can only add a hop",
            (RequestClass("short", SHORT_PROMPT, 32, num_requests=24, rate=1.0 / (b.e2e_ms(32) / 1000.0),
                          slo=short_slo),)),
        "long_high_load": ClusterWorkload(
            "long_high_load", "long prompts at 110% of one replica's prefill capacity",
            (RequestClass("long", LONG_PROMPT, 16, num_requests=12, rate=LONG_LOAD * 2 / long_s, slo=long_slo),)),
        "mixed": ClusterWorkload(
            "mixed", "~2 short-prompt streams decode while long prompts arrive (interference)",
            (RequestClass("short", SHORT_PROMPT, 32, num_requests=num_short_mixed, rate=2.0 / stream_s,
                          slo=short_slo),
             RequestClass("long", LONG_PROMPT, 8, num_requests=num_long_mixed, interval_s=long_interval_s,
                          start_s=long_interval_s / 2, slo=long_slo))),
    }


def measure_baseline(url: str, mode: str = "local", num_samples: int = 3, seed: int = 7) -> Baseline:
    """Sequential requests, nothing else running: median TTFT of a short and of a long
    prompt, median TPOT of a 32-token stream."""
    rng = random.Random(seed)
    short_len, long_len = sum(SHORT_PROMPT) // 2, sum(LONG_PROMPT) // 2
    shorts, longs = [], []
    with httpx.Client(timeout=300) as http:
        for _ in range(num_samples):
            shorts.append(_timed(http, url, mode, _prompt(rng, short_len), 32))
            longs.append(_timed(http, url, mode, _prompt(rng, long_len), 2))
            time.sleep(0.2)
    return Baseline(ttft_short_ms=round(statistics.median(t for t, _ in shorts), 2),
                    ttft_long_ms=round(statistics.median(t for t, _ in longs), 2),
                    tpot_ms=round(statistics.median(p for _, p in shorts), 2))


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 127) for _ in range(n)]


def _timed(http: httpx.Client, url: str, mode: str, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(TTFT ms, TPOT ms) of one streamed request."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True,
            "min_tokens": max_tokens, "return_token_ids": True}
    start = time.perf_counter()
    stamps, num_tokens = [], 0
    with http.stream("POST", f"{url}/v1/completions", json=body, headers={"x-pd-mode": mode}) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                choices = json.loads(line[5:]).get("choices") or [{}]
                if choices and choices[0].get("token_ids"):  # a chunk may carry several tokens
                    stamps.append(time.perf_counter())
                    num_tokens += len(choices[0]["token_ids"])
    if not stamps:
        raise RuntimeError("baseline request produced no tokens")
    ttft = stamps[0] - start
    tpot = (stamps[-1] - stamps[0]) / (num_tokens - 1) if num_tokens > 1 else 0.0
    return ttft * 1000.0, tpot * 1000.0


def describe(b: Baseline) -> dict:
    return dict(asdict(b), slo_scale=SLO_SCALE, long_load=LONG_LOAD)
