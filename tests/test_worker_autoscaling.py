"""Serve's autoscaler counts the calls that arrive over the worker stream: a pool busy
only with stream calls scales up as it would for the same calls through handles, and
the policy is set on autoscaled pools (and only where the config did not name one)."""

from __future__ import annotations

import pytest

from cluster.app import _pool
from cluster.config import load_config
from workers.autoscaling import POLICY, STREAM_CALLS, stream_aware_policy, with_stream_policy


def _context(handle_requests: float, stream_calls: list[float], num_replicas: int = 1):
    from ray.serve._private.common import DeploymentID, ReplicaID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    config = AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=2,
                               upscale_delay_s=0, downscale_delay_s=0, metrics_interval_s=0.1)
    dep = DeploymentID(name="DecodeWorker", app_name="pd")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(num_replicas)]
    return AutoscalingContext(
        deployment_id=dep, deployment_name="DecodeWorker", app_name="pd",
        current_num_replicas=num_replicas, target_num_replicas=num_replicas, running_replicas=replicas,
        total_num_requests=handle_requests, total_queued_requests=0.0,
        aggregated_metrics={STREAM_CALLS: dict(zip(replicas, stream_calls, strict=False))},
        raw_metrics=None, capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8,
        policy_state={}, last_scale_up_time=None, last_scale_down_time=None, current_time=1000.0,
        config=config)


def test_stream_calls_scale_a_pool_up_like_handle_requests():
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    via_stream, _ = stream_aware_policy(_context(0.0, [8.0]))
    via_handles, _ = replica_queue_length_autoscaling_policy(_context(8.0, [0.0]))
    idle, _ = stream_aware_policy(_context(0.0, [0.0]))
    assert via_stream == via_handles > 1
    assert idle <= 1  # (Serve clamps the decision to min_replicas afterwards)


def test_both_kinds_of_request_add_up():
    mixed, _ = stream_aware_policy(_context(4.0, [2.0, 2.0], num_replicas=2))
    from ray.serve.autoscaling_policy import replica_queue_length_autoscaling_policy

    same, _ = replica_queue_length_autoscaling_policy(_context(8.0, [0.0, 0.0], num_replicas=2))
    assert mixed == same


@pytest.mark.parametrize("worker_stream", [True, False])
def test_autoscaled_pools_get_the_policy_unless_they_name_one(worker_stream):
    auto = {"min_replicas": 1, "max_replicas": 3}
    config = load_config({"decode": {"autoscaling_config": auto},
                          "prefill": {"autoscaling_config": {**auto, "policy": {"policy_function":
                                                                                 "ray.serve.autoscaling_policy:replica_queue_length_autoscaling_policy"}}},
                          "router": {"worker_stream": worker_stream}})
    decode = _pool(config, "decode")._deployment_config.autoscaling_config
    prefill = _pool(config, "prefill")._deployment_config.autoscaling_config
    want = POLICY if worker_stream else "ray.serve.autoscaling_policy:default_autoscaling_policy"
    assert decode.policy.policy_function == want
    assert prefill.policy.policy_function.endswith(":replica_queue_length_autoscaling_policy")
    assert with_stream_policy({"policy": {"policy_function": "x:y"}}) == {"policy": {"policy_function": "x:y"}}
