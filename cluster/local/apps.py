"""The Serve app configs the demo and the cluster benchmark deploy.

Every engine replica gets one torch thread and the same engine settings (equal
`max_num_batched_tokens` everywhere), so a comparison differs only in how requests are
placed: two replicas that each prefill and decode (colocated), or one prefill and one
decode replica (disaggregated; `auto` lets the router decide per request).
"""

from __future__ import annotations

from typing import Any

# The chunked-prefill token budget of one engine step, the same in every deployment. 512
# (vLLM's old chunked-prefill default) is the colocated baseline's best defence against
# interference: a long prompt stalls the streams beside it for one 512-token chunk at a time.
MAX_NUM_BATCHED_TOKENS = 512
NUM_KV_BLOCKS = 2048  # 32k tokens per replica: never the limit in these workloads


def app_args(preset: str, cache_dir: str | None, num_prefill: int, num_decode: int,
             mode: str = "auto", *, max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS,
             admin_token_file: str | None = None, faults: bool = False) -> dict[str, Any]:
    """`build_app` args: `num_prefill` + `num_decode` single-threaded engine replicas whose
    default profile is `mode` and lets a client pick the mode with `x-pd-mode`.
    `admin_token_file` turns the admin API on (profiles changed live, `/admin/policy`);
    `faults` lets the test-only fault injection be switched at run time (nothing is
    injected until it is)."""
    model: dict[str, Any] = {"preset": preset}
    if cache_dir:
        model["cache_dir"] = cache_dir
    pool = {"num_cpus": 1.0, "torch_threads": 1}
    return {
        "model": model,
        "engine": {"num_kv_blocks": NUM_KV_BLOCKS, "max_num_batched_tokens": max_num_batched_tokens},
        "prefill": {**pool, "num_replicas": num_prefill},
        "decode": {**pool, "num_replicas": num_decode},
        # Two saturated cores delay heartbeats by seconds: a 3 s silence must not mark a
        # busy replica dead. A remote prefill may queue behind others for long at high
        # load; "disagg" should stay disaggregated rather than fall back after 30 s.
        "router": {"num_cpus": 0.5, "heartbeat_timeout_s": 15.0, "prefill_timeout_s": 120.0},
        "transport": {"backend": "auto", "host": "127.0.0.1"},
        "workloads": {"default": workload_profile(mode)},
        "log_level": "WARNING",
        **({"secrets": {"admin_token_file": admin_token_file}} if admin_token_file else {}),
        **({"faults": {"enabled": True}} if faults else {}),
    }


def workload_profile(mode: str, slo: dict[str, float] | None = None) -> dict[str, Any]:
    """A full workload profile (what `PUT /admin/workloads/NAME` takes), the same routing
    knobs everywhere; `slo` None: the router's default SLO."""
    profile: dict[str, Any] = {"mode": mode, "allow_client_override": True, "min_remote_prefill_tokens": 256,
                               "max_prefill_queue": 4}
    if slo is not None:
        profile["slo"] = slo
    return profile


def expected_pools(num_prefill: int, num_decode: int) -> dict[str, int]:
    return {role: n for role, n in (("prefill", num_prefill), ("decode", num_decode)) if n}


def ensure_preset(preset: str, cache_dir: str | None, log=print) -> str:
    """Make the preset model once (first use), before replicas race to make it."""
    from cluster.config import ModelConfig
    from workers.model_files import resolve_model_path

    model = ModelConfig(preset=preset, **({"cache_dir": cache_dir} if cache_dir else {}))
    path = resolve_model_path(model)
    log(f"model: {preset} preset at {path}")
    return str(path)
