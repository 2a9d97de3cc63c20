"""Load tester pieces without a server: workloads, schedules, metrics, config."""

from __future__ import annotations

import json
import statistics

import pytest

from cluster.loadtest.client import Caps, RequestRecord, Target, build_body
from cluster.loadtest.config import SLO, LoadTestConfig
from cluster.loadtest.metrics import SUMMARY_KEYS, latency_block, percentile, summarize
from cluster.loadtest.schedule import gamma_arrivals, ramp_arrivals, trace_arrivals
from cluster.loadtest.workloads import BUILTIN_NAMES, take


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_builtin_workloads_are_byte_identical_for_a_seed(name):
    a, b, other = take(name, 7, 40), take(name, 7, 40), take(name, 8, 40)
    assert json.dumps([vars(s) for s in a]) == json.dumps([vars(s) for s in b])
    assert [s.prompt for s in a] != [s.prompt for s in other]
    assert len({s.request_id for s in a}) == 40


def test_prompt_lengths_are_exact_in_bytes_and_ids():
    for spec in take("chat-short", 0, 50):
        assert 64 <= spec.prompt_len <= 256
        assert len(spec.prompt_ids) == spec.prompt_len == len(spec.messages[0]["content"])
        assert all(32 <= i < 127 for i in spec.prompt_ids)
    assert all(1024 <= s.prompt_len <= 2048 for s in take("rag-long", 0, 10))


def test_shared_prefix_uses_few_system_prompts():
    specs = take("shared-prefix", 0, 60)
    systems = {s.messages[0]["content"] for s in specs}
    assert len(systems) <= 4 and len({s.messages[1]["content"] for s in specs}) == 60


def test_multi_turn_history_grows_per_session():
    specs = take("multi-turn", 0, 32)  # 8 sessions x 4 turns
    by_session: dict[str, list] = {}
    for s in specs:
        by_session.setdefault(s.session_id, []).append(s)
    assert len(by_session) == 8
    for turns in by_session.values():
        assert [len(t.messages) for t in turns] == [1, 3, 5, 7]
        assert all(turns[i + 1].messages[: len(turns[i].messages)] == turns[i].messages for i in range(3))


def test_user_workload_files(tmp_path):
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text('{"prompt": "hello", "output_len": 5}\n{"prompt_len": 33, "max_tokens": 7}\n'
                     '{"messages": [{"role": "user", "content": "hi"}], "id": "x"}\n')
    specs = take(str(jsonl), 0, 5)
    assert [s.output_len for s in specs[:3]] == [5, 7, 32]
    assert specs[0].prompt == "hello" and specs[1].prompt_len == 33 and specs[2].request_id == "x"
    assert specs[3].prompt == "hello" and specs[3].request_id != specs[0].request_id  # cycles
    yaml_file = tmp_path / "gen.yaml"
    yaml_file.write_text("workload: rag-long\nprompt_len: [100, 120]\noutput_len: 9\n")
    assert all(100 <= s.prompt_len <= 120 and s.output_len == 9 for s in take(str(yaml_file), 0, 20))
    bad = tmp_path / "bad.yaml"
    bad.write_text("workload: rag-long\nprompt_length: 5\n")
    with pytest.raises(ValueError, match="prompt_length"):
        take(str(bad), 0, 1)
    with pytest.raises(ValueError, match="neither a built-in"):
        take("no-such-workload", 0, 1)


def test_body_uses_token_ids_and_extensions_only_when_allowed():
    spec = take("chat-short", 0, 1)[0]
    target = Target("http://x", "completions", "m", {})
    rich = build_body(spec, target, Caps(True, True))
    assert rich["prompt"] == spec.prompt_ids and rich["ignore_eos"] and rich["min_tokens"] == spec.output_len
    plain = build_body(spec, target, Caps(False, False))
    assert plain["prompt"] == spec.prompt and "ignore_eos" not in plain
    chat = build_body(spec, Target("http://x", "chat", "m", {}), Caps(True, True))
    assert chat["messages"] == list(spec.messages) and "prompt" not in chat
    assert chat["stream_options"] == {"include_usage": True}


def test_gamma_schedule_rate_and_burstiness():
    poisson = gamma_arrivals(50.0, 1.0, 0, num_requests=5000)
    gaps = [b - a for a, b in zip(poisson, poisson[1:], strict=False)]
    assert poisson[0] == 0 and statistics.mean(gaps) == pytest.approx(0.02, rel=0.05)
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, rel=0.1)
    bursty = gamma_arrivals(50.0, 0.25, 0, num_requests=5000)
    bursty_gaps = [b - a for a, b in zip(bursty, bursty[1:], strict=False)]
    assert statistics.stdev(bursty_gaps) / statistics.mean(bursty_gaps) == pytest.approx(2.0, rel=0.15)
    timed = gamma_arrivals(10.0, 1.0, 0, duration_s=5.0)
    assert max(timed) < 5.0 and 30 < len(timed) < 75
    assert gamma_arrivals(10.0, 1.0, 3, num_requests=10) == gamma_arrivals(10.0, 1.0, 3, num_requests=10)


def test_ramp_schedule_speeds_up():
    offsets = ramp_arrivals(2.0, 50.0, 0, duration_s=10.0)
    first_half = sum(t < 5 for t in offsets)
    assert len(offsets) == pytest.approx(260, rel=0.15)  # integral of the rate
    assert first_half < (len(offsets) - first_half) / 2
    assert len(ramp_arrivals(5.0, 5.0, 0, num_requests=40)) == 40


def test_trace_schedule(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 101.5}\n{"timestamp": 100.0, "prompt_len": 9}\n{"timestamp": 100.25}\n')
    offsets, rows = trace_arrivals(trace)
    assert offsets == [0.0, 0.25, 1.5] and rows[0]["prompt_len"] == 9


def test_percentiles_match_numpy_linear():
    values = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(values, 50) == 3.0 and percentile(values, 90) == pytest.approx(7.6)
    assert latency_block([]) == dict.fromkeys(["mean", "p50", "p90", "p95", "p99", "max"])
    assert latency_block([0.001, 0.003])["mean"] == pytest.approx(2.0)


def _record(i, ttft, e2e, n, ok=True, route=None):
    r = RequestRecord(i, f"r{i}", "w", None, sent_at_s=i * 0.1, ended_at_s=i * 0.1 + e2e, ttft_s=ttft, e2e_s=e2e,
                      completion_tokens=n, num_chunks=n, route=route)
    if not ok:
        r.error_kind = "http_500"
    return r


def test_goodput_counts_requests_meeting_every_slo():
    records = [_record(0, 0.05, 1.05, 11, route="disagg"),  # tpot 100 ms
               _record(1, 0.20, 0.70, 11, route="local"),  # ttft 200, tpot 50
               _record(2, 0.05, 0.55, 11),  # tpot 50
               _record(3, 0.01, 0.02, 2, ok=False, route="local")]
    s = summarize(records, SLO(ttft_ms=100, tpot_ms=60), 10.0, {})
    assert s.goodput["fraction"] == 0.25 and s.requests == {"completed": 3, "failed": 1}
    assert s.goodput["requests_per_s"] == pytest.approx(1 / s.duration_s, rel=1e-3)
    assert s.errors == {"http_500": 1} and s.routes == {"disagg": 1, "local": 2}
    assert s.tpot_ms["max"] == pytest.approx(100.0) and s.itl_ms["mean"] is None
    assert summarize(records, SLO(), None, {}).goodput["fraction"] == 0.75
    assert tuple(s.to_dict()) == SUMMARY_KEYS


def test_config_validation_names_the_problem():
    with pytest.raises(ValueError, match="one load shape"):
        LoadTestConfig(url="http://x", rate=1, concurrency=2)
    with pytest.raises(ValueError, match="--duration or --num-requests"):
        LoadTestConfig(url="http://x", duration_s=1, num_requests=2)
    with pytest.raises(ValueError, match="--mode"):
        LoadTestConfig(url="http://x", mode="remote")
    with pytest.raises(ValueError, match="bad item"):
        SLO.parse("ttft=5")
    assert SLO.parse("ttft_ms=5, e2e_ms=9").as_dict() == {"ttft_ms": 5.0, "e2e_ms": 9.0}
    assert LoadTestConfig(url="http://x", mode="local", api_key="k").request_headers()["x-pd-mode"] == "local"
