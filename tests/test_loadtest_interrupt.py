"""Ctrl-C stops a load test's event loop even where the running coroutine swallowed the
cancellation it caused: `run_sync` raises KeyboardInterrupt rather than returning as if
the run had finished (an experiment then stops, restores and reports instead of going
on). Each case runs in a child process, which signals itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHILD = textwrap.dedent("""
    import asyncio, os, signal, threading
    from cluster.loadtest.runner import run_sync

    async def main(swallow):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            if not swallow:
                raise
        return "returned"

    async def quick():
        await asyncio.sleep(0)
        return "returned"

    signal.signal(signal.SIGINT, signal.default_int_handler)  # a suite run in the background inherits SIG_IGN
    case = os.environ["CASE"]
    if case != "quick":
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        print(run_sync(quick() if case == "quick" else main(case == "swallowed")))
    except KeyboardInterrupt:
        print("KeyboardInterrupt")
""")


@pytest.mark.parametrize("uvloop", ["1", "0"])
@pytest.mark.parametrize(("case", "expected"), [
    ("swallowed", "KeyboardInterrupt"),  # the coroutine caught its cancellation and returned
    ("propagated", "KeyboardInterrupt"),
    ("quick", "returned"),  # no Ctrl-C: the result as ever
])
def test_ctrl_c_always_interrupts_a_run(uvloop, case, expected):
    env = {"CASE": case, "PDC_LOADTEST_UVLOOP": uvloop, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == expected, done.stderr
