"""The machines under the engines: steps that spent a large share of their time waiting
for a core, because something else on the node (other replicas, the router, the HTTP
proxy, other tenants) was using the cores the engine needs."""

from __future__ import annotations

from cluster.doctor.evidence import Evidence
from cluster.doctor.finding import Finding

STEP_SECONDS = "pdc_engine_step_seconds"
CROWDED_WAIT_SHARE = 0.25  # run-queue wait over CPU time of a pool's steps
MIN_CPU_SECONDS = 1.0  # of engine CPU time in the window, for a share to mean anything


def crowded_node(ev: Evidence) -> list[Finding]:
    """Per pool: the engine threads' run-queue wait over their CPU time in the steps of
    the window (`pdc_engine_step_seconds`, parts `cpu` and `run_wait`)."""
    if ev.window is None:
        return []
    shares: dict[str, dict[str, float]] = {}
    for pool in ("decode", "prefill"):
        cpu = ev.window.counter(STEP_SECONDS, pool=pool, part="cpu")
        wait = ev.window.counter(STEP_SECONDS, pool=pool, part="run_wait")
        wall = ev.window.counter(STEP_SECONDS, pool=pool, part="wall")
        if cpu >= MIN_CPU_SECONDS:
            shares[pool] = {"wait_share": round(wait / cpu, 3), "cpu_s": round(cpu, 2),
                            "run_wait_s": round(wait, 2), "wall_s": round(wall, 2)}
    crowded = {pool: s for pool, s in shares.items() if s["wait_share"] >= CROWDED_WAIT_SHARE}
    if not crowded:
        return []
    text = "; ".join(f"{pool} engines waited {s['run_wait_s']:.1f} s for a core over {s['cpu_s']:.1f} s of "
                     f"computing ({s['wait_share']:.0%})" for pool, s in crowded.items())
    return [Finding(
        "crowded-node", "Engines wait for a CPU core: their node is oversubscribed",
        f"{text}. Every step is that much slower than its work, and the wait scatters step times "
        "(a stream's gaps, the step model's predictions).",
        "Give each engine replica cores of its own: `num_cpus` of its pool (`prefill`/`decode` in the "
        "config) at least its `torch_threads` plus one, pod CPU requests that cover every replica on the "
        "node, the router and HTTP proxy on other cores or nodes, or fewer replicas per node; on a shared "
        "host, look for other tenants.",
        {"pools": shares})]
