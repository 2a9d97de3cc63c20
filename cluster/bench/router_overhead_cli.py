"""`pdcluster bench router-overhead`: only the router-overhead step of `bench cluster`.

Deploys the `pd` app of `bench cluster` (1 prefill + 1 decode replica, policy `auto`) on
a local Ray and runs `cluster.bench.router_overhead.measure` `--repeats` times: HTTP through
the Serve proxy and the Router ingress vs a Serve handle straight to the decode replica.
With `--echo` it also measures the floor any HTTP ingress pays here: a trivial streaming
Serve deployment (`Echo` below) over HTTP vs through a handle.
One JSON object on stdout, progress on stderr.
"""

from __future__ import annotations

import json
import os
import statistics

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("router-overhead")(bench_router_overhead_cmd)


def bench_router_overhead_cmd(
    samples: int = typer.Option(30, min=1, help="Requests per path per repeat."),
    repeats: int = typer.Option(2, min=1, help="Measurements on the same deployment; medians reported."),
    preset: str = typer.Option("small", help="Embedded model preset (tiny, small)."),
    model_cache: str | None = typer.Option(None, help="Where the preset is made once."),
    echo: bool = typer.Option(False, "--echo", help="Also measure a trivial echo deployment's HTTP hop."),
    serve_env: list[str] = typer.Option([], "--serve-env", help="KEY=VALUE for Ray's processes only (not "
                                        "this one), e.g. RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0."),
    direct_ingress: bool = typer.Option(False, "--direct-ingress", help="Serve's direct ingress: the client "
                                        "talks to the router replica itself, not through the HTTP proxy."),
) -> None:
    """The router's TTFT overhead over calling the decode replica directly (target: p50 ≤ 5 ms)."""
    import ray.serve  # noqa: F401 - this process reads Serve's settings now, before the env changes
    from rich.console import Console

    from cluster.bench.cluster import stdout_to_stderr

    console = Console(stderr=True, log_path=False)
    # Ray's processes inherit this environment when Ray starts; this one keeps what it read.
    os.environ.update(dict(kv.split("=", 1) for kv in serve_env))
    if direct_ingress:
        from cluster.local.ray_cluster import direct_ingress_env

        os.environ.update(direct_ingress_env())
    with stdout_to_stderr():
        result = run(samples, repeats, preset, model_cache, echo, console.log, direct_ingress)
    typer.echo(json.dumps(result))


def run(samples: int, repeats: int, preset: str, model_cache: str | None, echo: bool, log,
        direct_ingress: bool = False) -> dict:
    from cluster.bench.router_overhead import measure
    from cluster.local.apps import app_args, ensure_preset, expected_pools
    from cluster.local.ray_cluster import LocalCluster

    with LocalCluster(log=log) as cluster:
        ensure_preset(preset, model_cache, log)
        url = cluster.deploy("pd", app_args(preset, model_cache, 1, 1, "auto"), "/pd", expected_pools(1, 1))
        if direct_ingress:
            url = cluster.direct_url("pd", "/pd") or url
            log(f"direct ingress: the router replica answers at {url}")
        echo_url = _deploy_echo(cluster) if echo else None
        if echo_url and direct_ingress:
            echo_url = cluster.direct_url("echo", "/echo") or echo_url
        runs, echo_runs = [], []
        for i in range(repeats):
            runs.append(measure(url, "pd", num_samples=samples, seed=i))  # fresh prompts: no cache hits
            log(f"repeat {i}: {runs[-1]}")
            if echo_url:
                echo_runs.append(measure(echo_url, "echo", num_samples=samples, deployment="Echo"))
                log(f"echo {i}: {echo_runs[-1]}")
    return {"url": url, "serve_env": {k: v for k, v in os.environ.items() if k.startswith("RAY_SERVE_")},
            "medians": _medians(runs), "runs": runs,
            **({"echo_medians": _medians(echo_runs), "echo_runs": echo_runs} if echo else {})}


def _medians(runs: list[dict]) -> dict:
    """Per figure, the median over the runs that have it (`router_side_ttft_mean_ms` may be None)."""
    keys = dict.fromkeys(k for r in runs for k, v in r.items() if isinstance(v, float))
    return {k: round(statistics.median(r[k] for r in runs if isinstance(r.get(k), float)), 3) for k in keys}


def _deploy_echo(cluster) -> str:
    from ray import serve

    serve.run(Echo.bind(), name="echo", route_prefix="/echo")
    cluster.apps.append("echo")
    return cluster.url("/echo")


def _echo_deployment():
    """A Serve deployment with no work in it: the same two paths as the router overhead,
    an SSE stream over HTTP through the proxy and a chunk stream through a handle."""
    from ray import serve
    from starlette.responses import StreamingResponse

    from workers.protocol import GenerateChunk

    @serve.deployment(name="Echo", max_ongoing_requests=1000)
    class Echo:
        async def __call__(self, request) -> StreamingResponse:
            await request.body()

            async def events():
                yield 'data: {"choices":[{"index":0,"text":"a","finish_reason":null}]}\n\n'
                yield 'data: {"choices":[{"index":0,"text":"b","finish_reason":"length"}]}\n\n'
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        async def generate(self, req):
            yield GenerateChunk(token_ids=[97], text="a")
            yield GenerateChunk(token_ids=[98], text="b", finished=True, finish_reason="length")

    return Echo


Echo = _echo_deployment()
