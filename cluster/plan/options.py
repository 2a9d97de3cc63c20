"""The configurations `pdcluster plan` weighs for N replicas: every prefill:decode split
(a sample of them for large N) under each routing mode, plus all-colocated.

An option is a cluster shape and one routing rule for every workload: `local` on N
colocated replicas (no prefill pool), or P prefill + (N - P) decode replicas routed by
`auto` (the predictive policy), `disagg` (every prompt remote) or `threshold` at a few
token thresholds. The simulator runs each with the real placement and policy code.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.config import SLO, WorkloadProfile

THRESHOLDS = (128, 512, 1024)  # `threshold` mode: prefill remotely from this many uncached tokens
MAX_SPLITS = 12  # prefill pool sizes tried for one N (all of them for N <= MAX_SPLITS + 1)


@dataclass(frozen=True)
class PlanOption:
    num_prefill: int
    num_decode: int
    mode: str  # local | auto | disagg | threshold
    min_remote_prefill_tokens: int | None = None  # threshold only

    @property
    def num_replicas(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def name(self) -> str:
        if self.num_prefill == 0:
            return f"colocated {self.num_decode}"
        mode = self.mode if self.mode != "threshold" else f"threshold@{self.min_remote_prefill_tokens}"
        return f"{self.num_prefill}P:{self.num_decode}D {mode}"

    @property
    def disaggregated(self) -> bool:
        return self.num_prefill > 0

    def profile(self, slo: SLO) -> WorkloadProfile:
        """The profile every workload is routed by under this option."""
        extra = {} if self.min_remote_prefill_tokens is None else {
            "min_remote_prefill_tokens": self.min_remote_prefill_tokens}
        return WorkloadProfile(mode=self.mode, slo=slo, **extra)

    def scaled_to(self, num_replicas: int) -> PlanOption:
        """The same mode and about the same prefill share at another replica count."""
        if self.num_prefill == 0:
            return PlanOption(0, num_replicas, "local")
        prefill = min(num_replicas - 1, max(1, round(num_replicas * self.num_prefill / self.num_replicas)))
        return PlanOption(prefill, num_replicas - prefill, self.mode, self.min_remote_prefill_tokens)


def prefill_sizes(num_replicas: int, max_splits: int = MAX_SPLITS) -> list[int]:
    """Prefill pool sizes 1..N-1, thinned to about `max_splits` spread evenly for large N."""
    sizes = list(range(1, num_replicas))
    if len(sizes) <= max_splits:
        return sizes
    step = (num_replicas - 1) / max_splits
    return sorted({max(1, min(num_replicas - 1, round(1 + i * step))) for i in range(max_splits)})


def plan_options(num_replicas: int, modes: tuple[str, ...] = ("auto", "disagg", "threshold"),
                 thresholds: tuple[int, ...] = THRESHOLDS, max_splits: int = MAX_SPLITS) -> list[PlanOption]:
    """All-colocated first, then each split under each mode."""
    if num_replicas < 1:
        raise ValueError("plan needs at least 1 replica")
    out = [PlanOption(0, num_replicas, "local")]
    for prefill in prefill_sizes(num_replicas, max_splits):
        decode = num_replicas - prefill
        for mode in modes:
            if mode == "threshold":
                out += [PlanOption(prefill, decode, "threshold", t) for t in thresholds]
            else:
                out.append(PlanOption(prefill, decode, mode))
    return out
