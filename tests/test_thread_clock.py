"""The engine thread's CPU time and run-queue wait, as step records carry them."""

from __future__ import annotations

import threading
import time

from workers.engine.thread_clock import ThreadClock, ThreadTimes


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_cpu_time_counts_work_and_not_sleep():
    clock = ThreadClock()
    start = clock.read()
    spin(0.05)
    worked = clock.read() - start
    assert 0.03 <= worked.cpu_s <= 0.2  # a loaded CI core may give the spin less than all of it
    start = clock.read()
    time.sleep(0.05)
    slept = clock.read() - start
    assert slept.cpu_s < 0.01 and slept.wait_s >= 0.0


def test_each_thread_reads_its_own_times():
    clock, seen = ThreadClock(), {}

    def idle() -> None:
        start = clock.read()
        time.sleep(0.05)
        seen["idle"] = clock.read() - start

    worker = threading.Thread(target=idle)
    start = clock.read()
    worker.start()
    spin(0.05)
    worker.join()
    assert (clock.read() - start).cpu_s >= 0.03
    assert seen["idle"].cpu_s < 0.01


def test_without_schedstat_the_wait_reads_zero(tmp_path):
    clock = ThreadClock(str(tmp_path / "missing"))
    start = clock.read()
    spin(0.02)
    elapsed = clock.read() - start
    assert elapsed.wait_s == 0.0 and elapsed.cpu_s > 0.0
    assert ThreadTimes(2.0, 1.0) - ThreadTimes(0.5, 0.25) == ThreadTimes(1.5, 0.75)
