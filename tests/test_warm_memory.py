"""glibc malloc tuned by the engine: a step's multi-MiB tensors reuse warm pages instead of
faulting fresh ones in on every step."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import textwrap

import pytest

from workers.engine.warm_memory import keep_freed_memory_warm

HAS_MALLOPT = hasattr(ctypes.CDLL(None), "mallopt")

# A fresh process: builds an engine (or not), then makes the same step six times and
# prints the page faults of each: three 7 MiB activations alive at once, then freed.
# Untuned, glibc's dynamic thresholds (set by the 8 MiB block freed first: heap blocks
# below 8 MiB, heap tops above 16 MiB given back) return the 21 MiB heap top to the
# kernel after every step, so every step faults its activations in again.
STEP_PATTERN = textwrap.dedent("""
    import resource, sys, torch
    if sys.argv[1] == "engine":
        from workers.engine.llm_engine import LLMEngine
        LLMEngine(sys.argv[2], num_kv_blocks=64, device="cpu")
    torch.ones(2 << 20)  # 8 MiB, freed at once
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        activations = [torch.ones(7 << 18) for _ in range(3)]  # 7 MiB each, written
        del activations
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(" ".join(map(str, faults)))
""")



def _step_faults(*args: str) -> list[int]:
    done = subprocess.run([sys.executable, "-c", STEP_PATTERN, *args], capture_output=True, text=True,
                          check=True, timeout=120)
    return [int(n) for n in done.stdout.split()]


def test_malloc_tuning_is_idempotent():
    assert keep_freed_memory_warm() == HAS_MALLOPT
    assert keep_freed_memory_warm() == HAS_MALLOPT


@pytest.mark.skipif(not HAS_MALLOPT, reason="glibc's mallopt is not available")
def test_an_engine_process_steps_without_faulting_its_activations_in(tiny_model_dir):
    """Once the first step has grown the heap, later ones fault nothing in (a 1,024-token
    prefill of the `small` preset made 10,000-48,000 faults a step untuned). One later step
    may grow the heap once more: an allocation from another of the process's threads can
    land in the freed space first."""
    tuned = _step_faults("engine", str(tiny_model_dir))
    untuned = _step_faults("bare")
    later = sorted(tuned[1:])
    assert sum(later[:-1]) < 100, f"page faults per pass in an engine process: {tuned}"
    assert later[-1] < 3 * (7 << 18) * 4 // 4096, f"a step faulted more than its activations: {tuned}"
    assert sum(untuned[1:]) > 5000, f"untuned: {untuned}, tuned: {tuned}"
