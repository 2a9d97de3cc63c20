"""Serve autoscaling for worker pools whose requests arrive over the worker stream.

Serve's default policy scales on the requests it saw pass through its handles. Calls on
the worker stream (workers/stream/server.py) bypass the handles, so each replica reports
its open stream calls (`record_autoscaling_stats`, key `STREAM_CALLS`) and this policy
adds them to Serve's own count before applying Serve's default policy unchanged (its
target per replica, delays, smoothing and bounds). cluster/app.py sets it on a pool
that has an `autoscaling_config` without a policy of its own.
"""

from __future__ import annotations

from typing import Any

STREAM_CALLS = "pdc_stream_calls"
POLICY = "workers.autoscaling:stream_aware_policy"


def stream_aware_policy(ctx) -> tuple[int | float, dict[str, Any]]:
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    streamed = sum((ctx.aggregated_metrics or {}).get(STREAM_CALLS, {}).values())
    if streamed:
        # A cached_property in AutoscalingContext: an instance attribute overrides it
        # (tests/test_worker_autoscaling.py fails if a Ray upgrade makes that read-only).
        ctx.total_num_requests = ctx.total_num_requests + streamed
    return replica_queue_length_autoscaling_policy(ctx)


def with_stream_policy(autoscaling_config: dict[str, Any]) -> dict[str, Any]:
    """The pool's autoscaling_config, with this policy unless it names one itself."""
    if "policy" in autoscaling_config:
        return autoscaling_config
    return {**autoscaling_config, "policy": {"policy_function": POLICY}}
