"""`pdcluster loadtest` and `compare`: an open-loop load generator for OpenAI-compatible
endpoints. Import-light on purpose (the CLI loads this package for `--help`): the API is
loaded on first use.

    from cluster.loadtest import LoadTestConfig, SLO, run_loadtest
    from cluster.loadtest.compare import compare   # (the module shadows a package-level name)
    summary = run_loadtest(LoadTestConfig(url="http://127.0.0.1:8000", rate=5, out_dir=...))
    compare([dir_a, dir_b], out_dir)
"""

from __future__ import annotations

__all__ = ["SLO", "LoadTestConfig", "Summary", "run_loadtest"]


def __getattr__(name: str):
    if name in ("LoadTestConfig", "SLO"):
        from cluster.loadtest import config

        return getattr(config, name)
    if name == "Summary":
        from cluster.loadtest.metrics import Summary

        return Summary
    if name == "run_loadtest":
        from cluster.loadtest.api import run_loadtest

        return run_loadtest
    raise AttributeError(name)
