"""`python -m cluster.bench.gpu_check` runs on a GPU machine that has no Ray wheel: everything
it imports, at the top and inside its functions, must work with `ray` unimportable.

A `sitecustomize` on PYTHONPATH makes every `import ray...` fail, in the test's
interpreter and in the processes it spawns. Ray is installed here, so this is the only
way to see a stray import (guarded or not) on the path the GPU machine takes."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU_CHECK = ROOT / "cluster" / "bench" / "gpu_check.py"

BLOCK_RAY = '''
import sys

class _NoRay:
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: the GPU machine has no Ray)")
        return None

sys.meta_path.insert(0, _NoRay())
'''

# In the blocked interpreter: import what gpu_check imports anywhere, make the tiny model,
# run the engine on CPU and the two-process exchange through host slots, then check.
PROBE = '''
import importlib, json, sys, tempfile
modules = json.loads(sys.argv[1])
for name in modules:
    importlib.import_module(name)
from cluster.bench import gpu_check
from workers.engine import LLMEngine, SamplingParams
from workers.model_files import make_model
with tempfile.TemporaryDirectory() as tmp:
    engine = LLMEngine(str(make_model(tmp + "/tiny", "tiny", 0)), device="cpu", dtype="float32")
    out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
ipc = gpu_check.check_ipc_transfer("cpu")
try:
    import ray  # noqa: F401
    blocked = False
except ModuleNotFoundError:
    blocked = True
print(json.dumps({"blocked": blocked, "tokens": len(out[0].token_ids), "ipc": ipc,
                  "ray_modules": sorted(m for m in sys.modules if m.split(".")[0] == "ray"
                                        and sys.modules[m] is not None)}))
'''


def imported_by_gpu_check() -> list[str]:
    """Every project module gpu_check imports, at the top or in a function."""
    names = set()
    for node in ast.walk(ast.parse(GPU_CHECK.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return sorted(n for n in names if n.split(".")[0] in ("workers", "transport", "router", "cluster"))


def run_without_ray(tmp_path: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(BLOCK_RAY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_gpu_check_runs_with_ray_unimportable(tmp_path):
    proc = run_without_ray(tmp_path, "-m", "cluster.bench.gpu_check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result.get("ok", True), result  # {"cuda": false} here; the real checks on a GPU


def test_everything_gpu_check_runs_works_without_ray(tmp_path):
    modules = imported_by_gpu_check()
    assert {"transport.factory", "workers.engine", "workers.model_files"} <= set(modules), modules
    proc = run_without_ray(tmp_path, "-c", PROBE, json.dumps(modules))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["blocked"], "the Ray blocker did not engage"
    assert result["ray_modules"] == []
    assert result["tokens"] == 2
    assert result["ipc"] == {"ipc_bit_identical": True, "ipc_sender": "ok", "ipc_device_mappings": 0}
