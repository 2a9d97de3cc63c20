"""The KV seam's own rules: block counts, and an interface that imports without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from workers.engine.kv_types import KVLayout, num_blocks


def test_num_blocks_counts_a_partly_filled_last_block():
    assert [num_blocks(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]
    layout = KVLayout("m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")
    assert layout.num_blocks(9) == num_blocks(9, 4) == 3
    assert layout.layer_nbytes(3) == 2 * 3 * 4 * 2 * 8 * 2


def test_the_interface_imports_without_torch():
    """The router counts blocks with it; torch must come in only where a method needs it."""
    code = "import sys, workers.engine.kv_types; print('torch' in sys.modules)"
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root)
    assert out.stdout.strip() == "False"
