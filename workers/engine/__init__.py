"""The paged-KV continuous-batching engine (offline API of INTERFACES.md).

Names load lazily so that light users (the router importing `prefix_hash`) do not pull
in torch and transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "LLMEngine": "workers.engine.llm_engine",
    "RequestOutput": "workers.engine.sequence",
    "SamplingParams": "workers.engine.sampling_params",
    "block_hashes": "workers.engine.prefix_hash",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
