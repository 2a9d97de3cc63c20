"""What a GPU machine proves for the `shm` path's CUDA IPC half: `python -m
cluster.bench.gpu_check` (checked here to run, without Ray, on CPU too), two processes moving
bf16 CUDA layers bit-identically, and a CUDA decode engine continuing token-identically
after import. The CPU-side protocol tests are in `tests/test_transport_cuda_ipc.py`."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
import sys

import pytest
import torch

from tests.test_transport_backends import KEY, config, spawn

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# -- the device check script -------------------------------------------------------------------

def test_gpu_check_runs_on_cpu_and_says_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script runs its real checks (see needs_cuda)")
    proc = subprocess.run([sys.executable, "-m", "cluster.bench.gpu_check"], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"cuda": False}
    assert "no CUDA" in proc.stderr
    assert "ray" not in subprocess.run(
        [sys.executable, "-c", "import sys, cluster.bench.gpu_check, transport.factory, workers.model_files;"
         " print(' '.join(m for m in sys.modules if m.split('.')[0] == 'ray'))"],
        capture_output=True, text=True, timeout=120, check=True).stdout.split()


def test_gpu_check_harness_moves_layers_on_cpu():
    """The script's two-process exchange, through host slots here (no GPU)."""
    from cluster.bench.gpu_check import check_ipc_transfer

    assert check_ipc_transfer("cpu") == {"ipc_bit_identical": True, "ipc_sender": "ok",
                                         "ipc_device_mappings": 0}


# -- real CUDA IPC (GPU machines only) ---------------------------------------------------------

@needs_cuda
def test_gpu_check_passes():
    proc = subprocess.run([sys.executable, "-m", "cluster.bench.gpu_check"], capture_output=True,
                          text=True, timeout=300, check=False)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 0 and result["ok"], (result, proc.stderr[-2000:])


@needs_cuda
def test_bf16_cuda_layers_between_processes_are_bit_identical():
    """gpu_check's exchange: three transfers from a sender process, the later ones GPU to GPU."""
    from cluster.bench.gpu_check import check_ipc_transfer

    result = check_ipc_transfer("cuda")
    assert result["ipc_bit_identical"] and result["ipc_sender"] == "ok", result
    assert result["ipc_device_mappings"] > 0, result  # not staged through host slots


@needs_cuda
def test_cuda_decode_engine_continues_token_identically(tiny_model_dir):
    from tests.test_transport_engine import GREEDY, PROMPT, prefill_worker, run_local
    from transport.factory import make_receiver
    from workers.engine import LLMEngine

    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    proc = spawn(prefill_worker, str(tiny_model_dir), jobs, results, "cuda", "bfloat16")
    local, decode = (LLMEngine(str(tiny_model_dir), block_size=16, num_kv_blocks=64, device="cuda",
                               dtype="bfloat16") for _ in range(2))
    rx = make_receiver(config("shm"), decode, KEY)
    try:
        for n in range(3):  # the first goes through host slots, until the probe's answer
            fresh = [(t + n) % 250 for t in PROMPT]  # a reference run elsewhere: all of it moves
            want = run_local(local, fresh, GREEDY, 0)
            tid = f"cuda-engine-{n}"
            res = decode.reserve_kv(tid, fresh)
            rx.expect(tid, res, timeout=60)
            jobs.put(("shm", tid, rx.address, fresh, GREEDY, 0, res.num_cached_blocks))
            first = rx.wait(tid).token_id
            assert results.get(timeout=60) == (tid, "ok")
            decode.commit_kv(res, tid, GREEDY, first, seed=0)
            out = []
            while decode.has_unfinished_requests():
                out += [o for o in decode.step() if o.finished]
            assert out[-1].token_ids == want, n
        assert rx._paths["shm"]._device._mappings  # noqa: SLF001
    finally:
        jobs.put(None)
        proc.join(timeout=30)
        rx.close()
