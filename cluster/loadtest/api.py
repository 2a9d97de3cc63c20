"""The Python API: `run_loadtest(config) -> Summary`, what `pdcluster loadtest` runs."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

from cluster.loadtest.config import LoadTestConfig
from cluster.loadtest.metrics import Summary, summarize
from cluster.loadtest.runner import OnRecord, Plan, build_plan
from cluster.loadtest.session import environment, open_session, run_plan


def run_loadtest(config: LoadTestConfig, on_record: OnRecord | None = None) -> Summary:
    """Run the load test `config` describes; write its report to `config.out_dir` if set.
    A sweep returns the summary of the highest rate meeting the SLO (else its last rate),
    with the whole sweep in `env["sweep"]`. With `save_steps`, the deployment's step and
    KV transfer records over the run go beside it (`cluster/plan/live.py`); with
    `save_metrics`, the server's `/metrics` over the run (`server_metrics.py`)."""
    if config.save_steps:
        from cluster.plan.live import saving_steps

        with saving_steps(config.url, config.out_dir, config.admin_token):
            return _run_loadtest(config, on_record)
    return _run_loadtest(config, on_record)


def _run_loadtest(config: LoadTestConfig, on_record: OnRecord | None) -> Summary:
    if config.sweep:
        from cluster.loadtest.sweep import run_sweep

        with _metrics_window(config):
            return run_sweep(config)
    session = open_session(config)
    plan = build_plan(config)
    progress = None
    if config.progress and on_record is None:
        from cluster.loadtest.report import LiveProgress

        progress = LiveProgress(_expected_count(config, plan), config.duration_s)
        on_record = progress.update
    loop_lags_s: list[float] = []
    try:
        with _metrics_window(config):  # opened after the probe, so it holds the run's requests only
            records = run_plan(config, session, plan, on_record, loop_lags_s)
    finally:
        if progress is not None:
            progress.close()
    env = environment(config, session, plan, records, loop_lags_s)
    summary = summarize(records, config.slo, plan.target_rate, env)
    if config.out_dir is not None:
        from cluster.loadtest.report import write_report

        write_report(config.out_dir, summary, records, plots=config.plots)
    return summary


def _metrics_window(config: LoadTestConfig) -> AbstractContextManager:
    if not config.save_metrics:
        return nullcontext()
    from cluster.loadtest.server_metrics import recording_metrics

    return recording_metrics(config.url, config.out_dir)


def _expected_count(config: LoadTestConfig, plan: Plan) -> int | None:
    return len(plan.specs) if plan.specs is not None else plan.num_requests
