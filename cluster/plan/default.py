"""The calibration `pdcluster plan` uses when given none: the embedded `tiny` model swept
on this machine on first use, then read from a cache.

The cache file's name is a hash of everything that would change the sweep's result: the
preset and its weight seed, pdcluster's version, a digest of the engine's source
(`workers/engine/*.py`: a change to a step's code changes its cost) and of the sweep's
own code, the device, the dtype and the torch thread count. The cache lives under `$PDC_CACHE_DIR`, else
`~/.cache/pdcluster/`, beside the embedded models. Concurrent first uses sweep once
(a file lock).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

from cluster.plan.calibration import Calibration
from cluster.plan.model_facts import engine_version
from cluster.plan.sweep_source import DEFAULT_TORCH_THREADS, from_sweep

CACHE_ENV = "PDC_CACHE_DIR"
DEFAULT_PRESET = "tiny"


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "pdcluster")


def engine_source_digest() -> str:
    """A digest of the engine's source files and the sweep's own, so a change to either
    recalibrates."""
    import workers.engine

    here = Path(__file__).parent
    files = [*sorted(Path(workers.engine.__file__).parent.glob("*.py")),
             *(here / name for name in ("sweep.py", "sweep_source.py", "fit.py"))]
    h = hashlib.blake2b(digest_size=8)
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def cache_key(preset: str, seed: int, device: str, dtype: str, torch_threads: int,
              max_points: int | None = None) -> dict:
    return {"preset": preset, "seed": seed, "engine_version": engine_version(), "engine_source": engine_source_digest(),
            "device": device, "dtype": dtype, "torch_threads": torch_threads, "max_points": max_points}


def cache_path(key: dict) -> Path:
    name = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=8).hexdigest()
    return cache_dir() / "calibrations" / f"{key['preset']}-{key['device']}-{key['dtype']}-{name}.json"


def default_calibration(preset: str = DEFAULT_PRESET, device: str = "cpu", dtype: str = "float32",
                        torch_threads: int = DEFAULT_TORCH_THREADS, seed: int = 0,
                        max_points: int | None = None, on_point=None, on_grid=None) -> Calibration:
    """The calibration read from the cache, or swept now and cached (`default_calibration_file`)."""
    return Calibration.load(default_calibration_file(preset, device, dtype, torch_threads, seed, max_points,
                                                     on_point, on_grid))


def default_calibration_file(preset: str = DEFAULT_PRESET, device: str = "cpu", dtype: str = "float32",
                             torch_threads: int = DEFAULT_TORCH_THREADS, seed: int = 0,
                             max_points: int | None = None, on_point=None, on_grid=None) -> Path:
    """The cached calibration's path, sweeping first when there is none (`on_grid(number
    of points)` and `on_point(done, total)` report a sweep's progress)."""
    from workers.model_files import ensure_model

    key = cache_key(preset, seed, device, dtype, torch_threads, max_points)
    path = cache_path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".sweep.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            try:
                Calibration.load(path)
                return path
            except ValueError:  # an older format: sweep again
                pass
        with open(cache_dir() / ".make-model.lock", "w") as model_lock:
            fcntl.flock(model_lock, fcntl.LOCK_EX)
            model_dir = ensure_model(cache_dir() / f"{preset}-seed{seed}", preset, seed)
        calibration = from_sweep(model_dir, device, dtype, torch_threads, max_points,
                                 on_point=on_point, on_grid=on_grid)
        return calibration.save(path)
