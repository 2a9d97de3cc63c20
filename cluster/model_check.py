"""Fail at start-up, naming the path, when the model folder is missing or corrupt.

`check_model_dir(path)` reads only what is cheap to read (config.json, the safetensors
headers, the tokenizer files' presence), so `pdcluster serve` can refuse a bad folder in
well under a second, before it starts Ray, instead of deploying replicas that then fail
one by one in the background.
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster.config import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def check_model_dir(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_dir():
        raise ConfigError(f"model folder {path} does not exist (model.path / --model)")
    _check_config(path / "config.json")
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ConfigError(f"model folder {path} has no *.safetensors weights")
    for file in weights:
        _check_safetensors(file)
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise ConfigError(f"model folder {path} has no tokenizer (one of {', '.join(TOKENIZER_FILES)})")
    return path


def _check_config(file: Path) -> None:
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model folder {file.parent} has no config.json") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"model config {file} is unreadable or not JSON: {type(e).__name__}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"model config {file} has no model_type: not a HuggingFace config")


def _check_safetensors(file: Path) -> None:
    """The header parses and the data it describes fits in the file."""
    try:
        with file.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            if not 0 < header_len < 100 * 1024 * 1024:
                raise ValueError("bad header length")
            header = json.loads(f.read(header_len))
        ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
        if 8 + header_len + max(ends, default=0) > file.stat().st_size:
            raise ValueError("truncated")
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise ConfigError(f"model weights {file} are corrupt or truncated ({e})") from None
