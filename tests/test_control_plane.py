"""The router's shared state without Ray: the metrics merge every `/metrics` answer is
built from, the ControlPlane's registry and profiles (versions, forgetting silent
replicas, which sources are behind a moment), and the admin API's checks."""

from __future__ import annotations

import json

import pytest

from router import metrics
from router.admin import check_admin, parse_profile
from router.control_plane import ControlPlaneCore
from router.errors import APIError
from tests.fake_clock import FakeClock

# ---- metrics -----------------------------------------------------------------------


def test_metrics_merge_sums_counters_keeps_gauges_apart():
    a, b = metrics.RouterMetrics("tiny"), metrics.RouterMetrics("tiny")
    for m in (a, b):
        m.record_route("local", "short-prompt", "default")
        m.observe_ttft("local", "default", 0.01)
    text_gauges = (
        '# TYPE pdc_kv_blocks_free gauge\npdc_kv_blocks_free{model="tiny",pool="decode",replica="r1"} 5\n'
        '# TYPE pdc_prefix_cache_hits counter\npdc_prefix_cache_hits_total{model="tiny"} 2\n')
    text_gauges2 = text_gauges.replace('replica="r1"', 'replica="r2"').replace("} 5", "} 7")
    merged = metrics.merge([metrics.snapshot(a.registry), metrics.snapshot(b.registry),
                            metrics.from_text(text_gauges), metrics.from_text(text_gauges2)])
    out = metrics.render(json.loads(json.dumps(merged))).decode()
    assert 'pdc_route_decisions_total{model="tiny",reason="short-prompt",route="local",workload="default"} 2.0' in out
    assert 'pdc_time_to_first_token_seconds_count{model="tiny",route="local",workload="default"} 2.0' in out
    assert 'pdc_prefix_cache_hits_total{model="tiny"} 4.0' in out
    assert 'replica="r1"} 5.0' in out and 'replica="r2"} 7.0' in out
    assert "_created" not in out


# ---- control plane -----------------------------------------------------------------


def test_control_plane_profiles_versions_and_registry():
    clock = FakeClock()
    cp = ControlPlaneCore({"rag": {"mode": "disagg"}}, heartbeat_timeout_s=3.0, clock=clock)
    state = cp.get_state(None)
    assert set(state.profiles) == {"rag", "default"}
    assert cp.get_state(state.version).profiles is None  # unchanged: not resent
    version = cp.set_profile("rag", {"mode": "local"})
    assert version == state.version + 1
    assert cp.get_state(state.version).profiles["rag"]["mode"] == "local"
    with pytest.raises(ValueError):
        cp.set_profile("bad", {"mode": "never"})

    assert cp.heartbeat("d1", {}) is False  # unknown: the worker must register
    cp.register("d1", "decode", "node", "tcp://1.2.3.4:5", layout_fingerprint="abc")
    assert cp.heartbeat("d1", {"num_running": 2, "num_waiting": 1}, '# TYPE x gauge\nx 1\n') is True
    (info,) = cp.get_state().replicas
    assert info.healthy and info.load == 3 and info.extra == {"layout_fingerprint": "abc"}
    clock.now += 5  # heartbeat overdue
    assert not cp.get_state().replicas[0].healthy
    clock.now += 100  # forgotten, its counters retired into the sums
    assert cp.get_state().replicas == []


def test_control_plane_keeps_counters_of_forgotten_sources():
    clock = FakeClock()
    cp = ControlPlaneCore({}, clock=clock)
    m = metrics.RouterMetrics("tiny")
    m.record_route("disagg", "long-prompt", "default")
    cp.push_metrics("router:a", metrics.snapshot(m.registry))
    clock.now += 1000
    cp.push_metrics("router:b", metrics.snapshot(m.registry))
    assert 'reason="long-prompt",route="disagg",workload="default"} 2.0' in cp.render_metrics().decode()


def test_control_plane_names_the_sources_behind_a_moment():
    clock = FakeClock()
    cp = ControlPlaneCore({}, clock=clock)
    cp.register("d1", "decode")
    cp.heartbeat("d1", {}, "# TYPE x counter\nx_total 1\n")
    cp.push_metrics("router:a", "# TYPE y counter\ny_total 1\n")
    since = cp.now()
    assert cp.stale_sources(since - 1) == []
    assert cp.stale_sources(since + 0.5) == ["d1", "router:a"]
    clock.now += 0.5
    cp.heartbeat("d1", {}, "# TYPE x counter\nx_total 2\n")
    assert cp.stale_sources(since + 0.5) == ["router:a"]
    clock.now += 1000  # a source silent past the forget horizon is retired, not waited for
    cp.heartbeat("d1", {}, "# TYPE x counter\nx_total 3\n")
    assert cp.stale_sources(clock.now) == []


def test_replace_profiles_from_reconfigure_keeps_default():
    cp = ControlPlaneCore({})
    cp.replace_profiles({"x": {"mode": "local"}})
    assert set(cp.get_profiles()[1]) == {"x", "default"}


# ---- admin -------------------------------------------------------------------------


def test_admin_auth():
    with pytest.raises(APIError) as info:
        check_admin("Bearer x", None)
    assert info.value.status == 403
    for header in (None, "Bearer wrong", "Basic secret", "secret"):
        with pytest.raises(APIError) as info:
            check_admin(header, "secret")
        assert info.value.status == 401
    check_admin("Bearer secret", "secret")


def test_admin_profile_must_be_full_and_valid():
    full = {"mode": "local", "min_remote_prefill_tokens": 1, "max_prefill_queue": 1,
            "allow_client_override": False}
    assert parse_profile("rag", full).mode == "local"
    for body, param in (({k: v for k, v in full.items() if k != "mode"}, "mode"),
                        ({**full, "mode": "x"}, "mode"), ({**full, "max_prefill_queue": "1"}, "max_prefill_queue"),
                        ({**full, "extra": 1}, "extra"), ([], None)):
        with pytest.raises(APIError) as info:
            parse_profile("rag", body)
        assert info.value.status == 400 and info.value.param == param
