"""How fast the machine runs from moment to moment: a fixed piece of pure-Python work,
timed between the calls a benchmark measures.

On a shared host (a virtual CPU beside other tenants) the same work does not take the
same time twice: on the 2-core development VM a fixed loop of about 0.3 ms ran at p90
1.7 times and at p99 twice its median, and consecutive runs were correlated 0.92 (0.78
a hundred runs apart): the machine's speed drifts over tens of milliseconds. A latency
tail measured there is the code's tail times the machine's, so a benchmark reports the
probe's own tail beside it: a p99 / p50 of 2 for the probe means the machine alone
doubles the median at the p99, however constant the work.
"""

from __future__ import annotations

import time

PROBE_ITERATIONS = 1000  # about 0.05-0.1 ms of interpreter work on the development VM


def probe_ns() -> int:
    """Nanoseconds the fixed work took just now."""
    start = time.perf_counter_ns()
    total = 0
    for i in range(PROBE_ITERATIONS):
        total += i * i % 7
    return time.perf_counter_ns() - start
