"""One load-test run of a `ClusterWorkload` against a deployed app, through the load
tester's in-process API, and the figures the demo and the benchmark read from it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cluster.loadtest.metrics import Summary, latency_block
from cluster.local.traffic import ClusterWorkload, request_class


@dataclass
class Run:
    workload: ClusterWorkload
    mode: str
    out_dir: Path
    summary: Summary
    records: list  # every request's RequestRecord, as requests.jsonl holds it

    @property
    def by_class(self) -> dict[str, dict]:
        """Request class -> {"n", "ttft_ms", "itl_ms", "num_good"}."""
        return class_blocks(self.workload, self.records)

    def figures(self) -> dict:
        """The flat figures a benchmark keeps per run."""
        s, by_class = self.summary, self.by_class
        num_good = sum(block["num_good"] for block in by_class.values())
        num_sent = s.requests["completed"] + s.requests["failed"]
        return {
            "completed": s.requests["completed"], "failed": s.requests["failed"],
            "ttft_p50_ms": s.ttft_ms["p50"], "ttft_p99_ms": s.ttft_ms["p99"],
            "itl_p50_ms": s.itl_ms["p50"], "itl_p99_ms": s.itl_ms["p99"],
            "tpot_p50_ms": s.tpot_ms["p50"], "e2e_p50_ms": s.e2e_ms["p50"],
            # each request against its own class's SLO (the load tester's summary knows one SLO)
            "goodput_rps": round(num_good / s.duration_s, 4) if s.duration_s else None,
            "goodput_fraction": round(num_good / num_sent, 4) if num_sent else None,
            "throughput_rps": s.throughput["requests_per_s"],
            "routes": dict(s.routes),
            **{f"{name}_itl_p99_ms": block["itl_ms"]["p99"] for name, block in by_class.items()},
            **{f"{name}_ttft_p50_ms": block["ttft_ms"]["p50"] for name, block in by_class.items()},
        }


def run_workload(url: str, workload: ClusterWorkload, mode: str, out_dir: Path, seed: int,
                 progress: bool = False, plots: bool = False, trace_seed: int = 0, on_record=None) -> Run:
    """Replay `workload` against `url` with `x-pd-mode: mode`; the report goes to `out_dir`.
    `seed` picks the prompt bytes (give every run its own), `trace_seed` the lengths and
    arrival times (keep it fixed so every run sends the same shape of traffic).
    `on_record(record)` is called as each request ends (on the load tester's loop)."""
    from cluster.loadtest.api import run_loadtest
    from cluster.loadtest.config import LoadTestConfig
    from cluster.loadtest.report import read_records

    out_dir = Path(out_dir)
    trace = workload.write_trace(out_dir / "trace.jsonl", trace_seed)
    config = LoadTestConfig(url=url, out_dir=out_dir, workload=str(trace), trace=trace, seed=seed,
                            mode=mode, slo=workload.slo, progress=progress, plots=plots,
                            prompt_format="ids", timeout_s=300.0)
    summary = run_loadtest(config, on_record)
    return Run(workload, mode, out_dir, summary, read_records(out_dir))


def class_blocks(workload: ClusterWorkload, records) -> dict[str, dict]:
    """Per request class (`short`, `long`): TTFT, ITL, and how many met the class's SLO."""
    from cluster.loadtest.metrics import meets_slo

    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(request_class(r.request_id), []).append(r)
    return {name: {"n": len(rs),
                   "num_good": sum(meets_slo(r, workload.slo_of(name)) for r in rs),
                   "ttft_ms": latency_block([r.ttft_s for r in rs if r.ok and r.ttft_s is not None]),
                   "itl_ms": latency_block([g for r in rs if r.ok for g in r.itl_s])}
            for name, rs in sorted(groups.items())}


def warm_up(url: str, modes: tuple[str, ...], prompt_lens: tuple[int, ...] = (64, 512), concurrency: int = 2) -> None:
    """A few requests per mode before measuring: the first KV transfer between two
    replicas sets up its connection, and torch's first calls of a shape allocate."""
    import asyncio
    import random

    import httpx

    rng = random.Random(12345)

    async def one(http: httpx.AsyncClient, mode: str, prompt_len: int) -> None:
        body = {"prompt": [rng.randrange(32, 127) for _ in range(prompt_len)], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        resp = await http.post(f"{url}/v1/completions", json=body, headers={"x-pd-mode": mode})
        resp.raise_for_status()

    async def go() -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            for mode in modes:
                for prompt_len in prompt_lens:
                    await asyncio.gather(*(one(http, mode, prompt_len) for _ in range(concurrency)))

    asyncio.run(go())
