"""The simulator's scale check: the built-in `mixed` workload, 100,000 requests over 128
replicas at the rate that keeps them about 70% busy; prints the wall time and where it
went (`python -m cluster.plan.sim.scale`, `--profile` for a cProfile listing).

The rate is found, not guessed: a probe run on a small cluster (same prefill share)
measures the utilisation one request/s brings per replica, and the rate is scaled to
the target. Without `--calibration`, a fixed synthetic calibration of a small model on
a CPU (`reference_calibration`) sets the costs: the check is about the simulator's own
speed, not about any model's figures.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

from cluster.config import WorkloadProfile
from cluster.plan.calibration import Calibration, EngineLimits, FitQuality, StepModel, TransferModel
from cluster.plan.sim.arrivals import at_rate
from cluster.plan.sim.config import SimConfig
from cluster.plan.sim.simulator import simulate


def reference_calibration() -> Calibration:
    """Synthetic costs of the order the embedded tiny model shows on a CPU: 4 ms a step,
    50 us per prompt token, 0.2 ms per decode sequence; TCP at 1 GB/s."""
    return Calibration(
        model="reference", engine_version="synthetic", device="cpu", dtype="float32", source="sweep",
        created_at=0.0,
        limits=EngineLimits(block_size=16, num_kv_blocks=4096, max_num_seqs=32, max_num_batched_tokens=1024,
                            kv_bytes_per_token=4096, num_layers=4),
        step=StepModel(fixed_s=0.004, prefill_token_s=5e-5, prefill_attention_s=1e-9, decode_seq_s=2e-4,
                       decode_context_s=1e-7),
        transfer=TransferModel(fixed_s=0.002, bytes_per_s=1e9),
        quality=FitQuality(median_relative_error=0.0, p90_relative_error=0.0, num_fitted=0, num_held_out=0),
        request_overhead_s=0.002, notes="synthetic: for the simulator's scale check only")


def config_for(num_replicas: int, prefill_share: float, mode: str) -> SimConfig:
    num_prefill = round(num_replicas * prefill_share)
    return SimConfig(num_prefill=num_prefill, num_decode=num_replicas - num_prefill,
                     profiles={"default": WorkloadProfile(mode=mode)})


def rate_for(calibration: Calibration, num_replicas: int, target: float, prefill_share: float, mode: str,
             probe_replicas: int = 8, probe_requests: int = 1500) -> float:
    """The rate that keeps `num_replicas` at `target` utilisation: a first guess scaled
    from a small cluster, then corrected by short runs of the full cluster (busy time
    grows slower than the rate, batches amortising each step's fixed cost, and the
    router spreads work differently over more replicas)."""
    rate = _scaled_rate(calibration, probe_replicas, target, prefill_share, mode, 2.0 * probe_replicas,
                        probe_requests) * num_replicas / probe_replicas
    for _ in range(3):
        rate = _scaled_rate(calibration, num_replicas, target, prefill_share, mode, rate, 8000)
    return rate


def _scaled_rate(calibration: Calibration, num_replicas: int, target: float, prefill_share: float, mode: str,
                 rate: float, num_requests: int) -> float:
    config = config_for(num_replicas, prefill_share, mode)
    result = simulate(config, calibration, at_rate("mixed", rate, num_requests, seed=1))
    return rate * target / mean_utilisation(config, result.utilisation)


def mean_utilisation(config: SimConfig, utilisation: dict[str, float]) -> float:
    """Busy share over every replica of the cluster."""
    pools = (("prefill", config.num_prefill), ("decode", config.num_decode))
    return sum(utilisation.get(pool, 0.0) * n for pool, n in pools) / config.num_replicas


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", help="a calibration file (default: the synthetic reference)")
    parser.add_argument("--num-requests", type=int, default=100_000)
    parser.add_argument("--replicas", type=int, default=128)
    parser.add_argument("--utilisation", type=float, default=0.7)
    parser.add_argument("--prefill-share", type=float, default=0.25)
    parser.add_argument("--mode", default="auto")
    parser.add_argument("--rate", type=float, help="skip the probe: this rate")
    parser.add_argument("--profile", action="store_true", help="print the top of a cProfile listing")
    args = parser.parse_args(argv)
    calibration = Calibration.load(args.calibration) if args.calibration else reference_calibration()
    rate = args.rate or rate_for(calibration, args.replicas, args.utilisation, args.prefill_share, args.mode)
    started = time.perf_counter()
    arrivals = at_rate("mixed", rate, args.num_requests, seed=0)
    workload_s = time.perf_counter() - started
    config = config_for(args.replicas, args.prefill_share, args.mode)
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        profiler.enable()
    result = simulate(config, calibration, arrivals, rate)
    if profiler:
        profiler.disable()
    summary_started = time.perf_counter()
    summary = result.summary()
    report = {
        "num_requests": args.num_requests, "replicas": args.replicas, "prefill": config.num_prefill,
        "decode": config.num_decode, "mode": args.mode, "rate": round(rate, 2),
        "wall_s": round(time.perf_counter() - started, 2), "workload_s": round(workload_s, 2),
        "simulate_s": round(result.wall_s, 2), "router_decisions_s": round(result.decision_wall_s, 2),
        "router_feedback_s": round(result.feedback_wall_s, 2),
        "summary_s": round(time.perf_counter() - summary_started, 2),
        "simulated_s": round(result.duration_s, 1), "steps": result.num_steps, "events": result.num_events,
        "utilisation": {k: round(v, 3) for k, v in result.utilisation.items()},
        "utilisation_mean": round(mean_utilisation(config, result.utilisation), 3),
        "routes": result.routes(), "preemptions": result.num_preemptions,
        "ttft_p50_ms": summary.ttft_ms["p50"], "tpot_p50_ms": summary.tpot_ms["p50"],
    }
    print(json.dumps(report, indent=2))
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    return report


if __name__ == "__main__":
    main()
