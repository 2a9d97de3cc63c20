"""The router's process never loads torch: it tokenizes, validates and routes, and every
router replica that starts pays for what its imports load (torch alone is about a
second of CPU and a few hundred MB of memory). Checked in a fresh interpreter, since
this one has loaded torch for the engine's tests long ago."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_router_ingress_loads_no_torch():
    code = "import sys, router.ingress; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout[-2000:]
