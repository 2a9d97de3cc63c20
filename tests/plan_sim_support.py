"""Calibrations and arrivals built in code for the simulator's tests (no file, no engine)."""

from __future__ import annotations

from cluster.loadtest.schedule import gamma_arrivals
from cluster.loadtest.workloads import RequestSpec
from cluster.plan.calibration import Calibration, EngineLimits, FitQuality, StepModel, TransferModel
from cluster.plan.sim.arrivals import Arrival
from cluster.plan.sim.sequence import SimSeq


def calibration(fixed_s: float = 0.004, prefill_token_s: float = 5e-5, prefill_attention_s: float = 0.0,
                decode_seq_s: float = 2e-4, decode_context_s: float = 0.0, transfer_fixed_s: float = 0.002,
                bytes_per_s: float | None = 1e9, overhead_s: float = 0.0, **limits) -> Calibration:
    engine = dict(block_size=16, num_kv_blocks=4096, max_num_seqs=32, max_num_batched_tokens=1024,
                  kv_bytes_per_token=4096, num_layers=4, enable_prefix_caching=True) | limits
    return Calibration(
        model="test", engine_version="test", device="cpu", dtype="float32", source="sweep", created_at=0.0,
        limits=EngineLimits(**engine),
        step=StepModel(fixed_s=fixed_s, prefill_token_s=prefill_token_s, prefill_attention_s=prefill_attention_s,
                       decode_seq_s=decode_seq_s, decode_context_s=decode_context_s),
        transfer=TransferModel(fixed_s=transfer_fixed_s, bytes_per_s=bytes_per_s),
        quality=FitQuality(median_relative_error=0.0, p90_relative_error=0.0, num_fitted=0, num_held_out=0),
        request_overhead_s=overhead_s)


def spec(i: int, prompt_len: int, output_len: int, workload: str = "default", shared_prefix: str = "") -> RequestSpec:
    """A request whose prompt starts with its own index (no prefix-cache hit between two
    requests unless `shared_prefix` is given)."""
    head = shared_prefix + f"{i:08d}"
    text = (head + "a" * prompt_len)[:prompt_len]
    return RequestSpec(f"r-{i}", workload, ({"role": "user", "content": text},), output_len)


def poisson(rate: float, n: int, prompt_len: int, output_len: int, seed: int = 0) -> list[Arrival]:
    """`n` requests at Poisson times (the load tester's own schedule)."""
    offsets = gamma_arrivals(rate, 1.0, seed, n)
    return [Arrival(t, spec(i, prompt_len, output_len)) for i, t in enumerate(offsets)]


def at_once(lengths: list[tuple[int, int]], at_s: float = 0.0) -> list[Arrival]:
    return [Arrival(at_s, spec(i, p, o)) for i, (p, o) in enumerate(lengths)]


class Finishes:
    """A SimEngine listener recording when each sequence (by owner) finished; engines
    without remote prefills only."""

    def __init__(self) -> None:
        self.finished: dict[object, float] = {}

    def on_first_token(self, seq: SimSeq, now: float) -> None:
        pass

    def on_prefilled(self, seq: SimSeq, now: float) -> None:
        raise AssertionError("no remote prefill here")

    def on_finished(self, seq: SimSeq, now: float) -> None:
        self.finished[seq.owner] = now
