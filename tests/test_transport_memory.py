"""The transport's own memory helpers: the single-threaded copy and the shm slots."""

from __future__ import annotations

import os

import pytest
import torch

from transport.paths.base import copy_and_checksum, copy_bytes, tensor_bytes
from transport.wire import payload_checksum


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_copy_bytes_is_bit_exact(dtype):
    src = torch.randn(3, 5, 7).to(dtype)
    dst = torch.zeros(3 * 5 * 7 * src.element_size(), dtype=torch.uint8)
    copy_bytes(dst, src)
    assert torch.equal(dst.view(dtype).view(src.shape), src)


def test_copy_bytes_refuses_mismatched_sizes():
    with pytest.raises(ValueError):
        copy_bytes(torch.zeros(3), torch.zeros(4))


def test_copy_and_checksum_matches_the_one_pass_checksum():
    src = torch.randn(1000, 333)  # not a multiple of the chunk
    dst = torch.zeros_like(src)
    digest = copy_and_checksum(dst, src, chunk=4096)
    assert torch.equal(dst, src)
    assert digest == payload_checksum(tensor_bytes(src))


def test_sweep_removes_only_dead_senders_slots(tmp_path):
    """A killed sender leaves its /dev/shm slots behind; the next sender on the node
    unlinks those of dead pids and never a live process's (or a foreign file)."""
    import subprocess
    import sys

    from transport.paths.shm import sweep_dead_slots

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / f"pdc-kv-{dead_pid}-{'a' * 24}"
    live = tmp_path / f"pdc-kv-{os.getpid()}-{'b' * 24}"
    foreign = tmp_path / "pdc-kv-not-ours"
    for path in (stale, live, foreign):
        path.write_bytes(b"x")
    assert sweep_dead_slots(tmp_path) == 1
    assert not stale.exists() and live.exists() and foreign.exists()
