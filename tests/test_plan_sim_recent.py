"""A simulated replica reports the recent stream gap as a real replica computes it from
its step records (`recent_load`), and forgets steps older than the window."""

from __future__ import annotations

import pytest

from cluster.plan.sim.recent import RecentDecode
from workers.engine.recent_load import MIN_STEPS, WINDOW_S, recent_load
from workers.engine.step_cost import StepRecord


def _steps(durations_seqs: list[tuple[float, int]], start: float = 100.0) -> list[tuple[float, float, int]]:
    out, t = [], start
    for duration, seqs in durations_seqs:
        out.append((t, duration, seqs))
        t += duration
    return out


def test_the_same_figures_as_a_real_replica_from_its_records():
    steps = _steps([(0.004, 2)] * 30 + [(0.010, 6)] * 30 + [(0.004, 2)])
    records = [StepRecord(start_time=s, step_time_s=d, num_prefill_tokens=0, num_decode_seqs=n,
                          num_context_tokens=100 * n, num_running=n, num_waiting=0) for s, d, n in steps]
    recent = RecentDecode()
    for s, d, n in steps[:-1]:  # a real replica counts a step once the next has started
        recent.add(s + d, d, n)
    now = steps[-1][0] + steps[-1][1]
    real = recent_load(records, now)
    got = recent.stats(now)
    assert got["recent_stream_gap_s"] == pytest.approx(real.stream_gap_s)
    assert got["recent_decode_seqs"] == pytest.approx(real.decode_seqs)
    assert got["recent_decode_steps"] == real.num_steps == 60


def test_a_run_of_steps_counts_as_its_steps_and_old_ones_are_forgotten():
    recent = RecentDecode()
    recent.add(10.0, 0.4, 4, num_steps=100)  # 100 steps of 4 ms, 4 streams
    assert recent.stats(10.0) == {"recent_stream_gap_s": pytest.approx(0.004), "recent_decode_seqs": 4.0,
                                  "recent_decode_steps": 100}
    recent.add(12.0, 0.05, 1, num_steps=MIN_STEPS - 1)  # then a few of 1 stream, each 50 ms / (MIN_STEPS - 1)
    both = recent.stats(12.0)
    assert both["recent_decode_steps"] == 100 + MIN_STEPS - 1
    assert both["recent_stream_gap_s"] == pytest.approx((0.4 * 4 + 0.05) / (400 + MIN_STEPS - 1))
    assert both["recent_decode_seqs"] == pytest.approx((0.4 * 4 + 0.05) / 0.45)
    assert recent.stats(10.0 + WINDOW_S + 0.5) == {}  # the run left the window; too few steps remain
    assert recent.stats(12.0 + WINDOW_S + 1.0) == {}
