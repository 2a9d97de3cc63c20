"""Shared fixtures: one tiny model per test session (and one Ray cluster, where used)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores on CI: keep torch from oversubscribing when several processes run.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from cluster.make_model import make_model

    return make_model(tmp_path_factory.mktemp("models") / "tiny", "tiny", 0)
