"""What calibration needs from a model folder: its name, layers and KV bytes per token,
computed the way the engine lays out its cache (`kv_cache.layout_from_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


@dataclass(frozen=True)
class ModelFacts:
    name: str
    num_layers: int
    kv_bytes_per_token: int  # K and V over all layers, in the cache's dtype


def model_facts(model_dir: str | Path, dtype: str = "float32") -> ModelFacts:
    """From `config.json`; raises with what to do when the folder holds no model."""
    from transformers import AutoConfig

    from workers.engine.kv_cache import layout_from_config
    from workers.engine.model_runner import resolve_dtype

    path = Path(model_dir)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path}: no config.json; give a HuggingFace model folder "
                                f"(`pdcluster make-model DIR` writes one)")
    layout = layout_from_config(AutoConfig.from_pretrained(path), 1, resolve_dtype(dtype))
    return ModelFacts(path.resolve().name, layout.num_layers, layout.layer_nbytes(1) * layout.num_layers)


def engine_version() -> str:
    """pdcluster's installed version (the engine is part of it)."""
    try:
        return metadata.version("pdcluster")
    except metadata.PackageNotFoundError:
        return "unknown"
