"""Pure units of `pdcluster experiment`: the spec's rules, the run order, what each run
sets, the bootstrap verdicts, quality comparison and the recommendation. No server."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from cluster.config import WorkloadProfile
from cluster.experiment.analysis import recommend
from cluster.experiment.quality import NEAR_TIE, SampleOutput, compare, request_body, run_checks
from cluster.experiment.runner import (
    BASELINE,
    base_profile,
    client_for,
    describe_plan,
    profile_for,
    run_order,
)
from cluster.experiment.spec import Checks, ExperimentSpec, Sample, load_spec
from cluster.experiment.stats import METRICS
from cluster.experiment.stats import compare as compare_metric
from cluster.loadtest.client import RequestRecord
from cluster.loadtest.config import SLO

N_RESAMPLES = 200  # enough for a clear effect; keeps the file fast


def _spec(**over) -> ExperimentSpec:
    data = {"workloads": [{"name": "chat"}], "variants": [{"name": "local", "profile": {"mode": "local"}}]}
    data.update(over)
    return ExperimentSpec.model_validate(data)


def _refused(match: str, **over) -> None:
    with pytest.raises(ValidationError, match=match):
        _spec(**over)


# ---- spec -------------------------------------------------------------------------------------


def test_load_spec_reads_a_valid_file_with_samples_file(tmp_path):
    (tmp_path / "samples").mkdir()
    (tmp_path / "samples" / "q.jsonl").write_text(
        json.dumps({"id": "a", "prompt": "2+2=", "checks": {"regex": "4"}}) + "\n\n"
        + json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}) + "\n")
    (tmp_path / "exp.yaml").write_text(
        "name: routes\n"
        "workloads:\n  - name: chat\n    load: chat-short\n  - name: rag\n"
        "rate: 4\nnum_requests: 20\nrepeats: 2\n"
        "slo:\n  ttft_ms: 500\n"
        "samples:\n  - prompt: hello\n"
        "samples_file: samples/q.jsonl\n"
        "variants:\n"
        "  - name: local\n    profile: {mode: local}\n"
        "  - name: forced-disagg\n    client: {mode: disagg}\n")
    spec = load_spec(tmp_path / "exp.yaml")
    assert [w.name for w in spec.workloads] == ["chat", "rag"]
    assert [v.name for v in spec.variants] == ["local", "forced-disagg"]
    assert spec.rate == 4 and spec.repeats == 2 and spec.slo.ttft_ms == 500
    assert [s.prompt for s in spec.samples] == ["hello", "2+2=", None]  # inline first, then the file's
    assert spec.samples[1].id == "a" and spec.samples[1].checks.regex == "4"
    assert spec.samples[2].messages == [{"role": "user", "content": "hi"}] and spec.samples[2].max_tokens == 8
    assert spec.bound() == {"num_requests": 20}


def test_load_spec_names_the_problem(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("workloads: [{name: chat}]\nvariants: [{name: x, profile: {colour: red}}]\n")
    with pytest.raises(ValueError, match="unknown profile field 'colour'"):
        load_spec(path)
    path.write_text("- just a list\n")
    with pytest.raises(ValueError, match="expected a mapping"):
        load_spec(path)


def test_a_variant_changing_two_things_is_refused_unless_it_says_so():
    two = {"name": "both", "profile": {"mode": "local"}, "client": {"mode": "disagg"}}
    with pytest.raises(ValidationError) as e:
        _spec(variants=[two])
    assert "profile.mode" in str(e.value) and "client.mode" in str(e.value)
    assert "multiple_changes" in str(e.value)
    spec = _spec(variants=[{**two, "multiple_changes": True}])
    assert spec.variants[0].changes() == {"profile.mode": "local", "client.mode": "disagg"}


def test_a_header_counts_as_a_change():
    with pytest.raises(ValidationError, match="changes 2 things"):
        _spec(variants=[{"name": "h", "client": {"mode": "local", "headers": {"x-a": "1"}}}])


def test_unknown_or_invalid_profile_fields_are_refused():
    _refused("unknown profile field 'nope'", variants=[{"name": "v", "profile": {"nope": 1}}])
    _refused("baseline.profile: unknown profile field 'colour'",
             baseline={"profile": {"colour": "red"}})
    _refused("min_remote_prefill_tokens", variants=[{"name": "v", "profile": {"min_remote_prefill_tokens": -1}}])


def test_load_shape_and_names():
    _refused("rate .* or concurrency", rate=2, concurrency=4)
    _refused("num_requests or duration_s", num_requests=5, duration_s=10)
    _refused("unique and not 'baseline'", variants=[{"name": "a", "profile": {"mode": "local"}},
                                                   {"name": "a", "profile": {"mode": "disagg"}}])
    _refused("unique and not 'baseline'", variants=[{"name": "baseline", "profile": {"mode": "local"}}])
    _refused("workload names must be unique", workloads=[{"name": "w"}, {"name": "w"}])
    _refused("Extra inputs", colour="red")


def test_a_sample_needs_exactly_one_of_prompt_and_messages():
    with pytest.raises(ValidationError, match="exactly one"):
        Sample(prompt="a", messages=[{"role": "user", "content": "b"}])
    with pytest.raises(ValidationError, match="exactly one"):
        Sample()
    _refused("exactly one", samples=[{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}])


# ---- run order and what each run sets ---------------------------------------------------------


def test_run_order_interleaves_baseline_first():
    spec = _spec(repeats=2, workloads=[{"name": "w1"}, {"name": "w2"}],
                 variants=[{"name": "b", "profile": {"mode": "local"}}, {"name": "c", "client": {"mode": "disagg"}}])
    keys = run_order(spec)
    assert len(keys) == 2 * 2 * 3
    assert [k.index for k in keys] == list(range(12))
    assert [(k.repeat, k.workload, k.variant) for k in keys[:6]] == [
        (1, "w1", BASELINE), (1, "w1", "b"), (1, "w1", "c"),
        (1, "w2", BASELINE), (1, "w2", "b"), (1, "w2", "c")]
    assert [k.variant for k in keys] == [BASELINE, "b", "c"] * 4
    assert [k.repeat for k in keys] == [1] * 6 + [2] * 6
    assert keys[4].folder == "004-w2-b-r1"
    assert describe_plan(spec, None)[0].startswith("12 runs: 2 repeats x 2 workloads x 3 arms")


def test_profiles_with_the_baseline_as_it_is():
    spec = _spec(workloads=[{"name": "chat"}, {"name": "rag"}],
                 variants=[{"name": "thr", "profile": {"mode": "threshold", "min_remote_prefill_tokens": 64},
                            "multiple_changes": True},
                           {"name": "forced", "client": {"mode": "disagg"}}])
    current = WorkloadProfile(mode="disagg", max_prefill_queue=9).model_dump(mode="json")
    snapshot = {"chat": current, "default": WorkloadProfile().model_dump(mode="json")}
    assert profile_for(spec, snapshot, "chat", BASELINE) is None
    assert profile_for(spec, snapshot, "chat", "forced") is None  # a client change leaves the profile
    thr = profile_for(spec, snapshot, "chat", "thr")
    assert thr == {**current, "mode": "threshold", "min_remote_prefill_tokens": 64}
    assert set(thr) == set(WorkloadProfile.model_fields)  # every field: the PUT replaces the profile
    # a workload without its own profile: built on `default`
    assert profile_for(spec, snapshot, "rag", "thr") == {**snapshot["default"], "mode": "threshold",
                                                         "min_remote_prefill_tokens": 64}
    assert profile_for(spec, {}, "rag", "thr")["max_prefill_queue"] == WorkloadProfile().max_prefill_queue
    assert base_profile(spec, snapshot, "chat") == current
    lines = describe_plan(spec, snapshot)
    assert "  baseline: profile as it is; client as configured" in lines
    assert "  forced: profile as it is; mode=disagg" in lines


def test_a_given_baseline_profile_applies_to_the_baseline_and_under_each_variant():
    spec = _spec(baseline={"profile": {"mode": "threshold", "max_prefill_queue": 2}},
                 variants=[{"name": "t", "profile": {"min_remote_prefill_tokens": 1024}},
                           {"name": "c", "client": {"endpoint": "chat"}}])
    snapshot = {"chat": WorkloadProfile(mode="local", deadline_s=30).model_dump(mode="json")}
    base = profile_for(spec, snapshot, "chat", BASELINE)
    assert base["mode"] == "threshold" and base["max_prefill_queue"] == 2 and base["deadline_s"] == 30
    assert base == base_profile(spec, snapshot, "chat")
    assert profile_for(spec, snapshot, "chat", "t") == {**base, "min_remote_prefill_tokens": 1024}
    assert profile_for(spec, snapshot, "chat", "c") == base  # the baseline's profile under a client change


def test_client_settings_merge_and_the_variant_wins():
    spec = _spec(baseline={"client": {"mode": "auto", "endpoint": "chat", "headers": {"x-a": "1", "x-b": "2"}}},
                 variants=[{"name": "m", "client": {"mode": "local"}},
                           {"name": "h", "client": {"headers": {"x-b": "3"}}}])
    base = client_for(spec, BASELINE)
    assert (base.mode, base.endpoint, base.headers) == ("auto", "chat", {"x-a": "1", "x-b": "2"})
    m = client_for(spec, "m")
    assert (m.mode, m.endpoint, m.headers) == ("local", "chat", {"x-a": "1", "x-b": "2"})
    h = client_for(spec, "h")
    assert (h.mode, h.headers) == ("auto", {"x-a": "1", "x-b": "3"})


# ---- bootstrap verdicts ----------------------------------------------------------------------


def _records(n: int, ttft_s: float, rng: np.random.Generator, errors: int = 0, spacing_s: float = 0.1,
             tokens: int = 16) -> list[RequestRecord]:
    out = []
    for i in range(n):
        sent = i * spacing_s
        if i < errors:
            out.append(RequestRecord(i, f"r{i}", "w", None, sent_at_s=sent, ended_at_s=sent + 0.05,
                                     error_kind="http_500", status=500))
            continue
        ttft = ttft_s * float(rng.uniform(0.8, 1.2))
        e2e = ttft + 0.02 * (tokens - 1) * float(rng.uniform(0.9, 1.1))
        out.append(RequestRecord(i, f"r{i}", "w", None, sent_at_s=sent, ended_at_s=sent + e2e, ttft_s=ttft,
                                 e2e_s=e2e, completion_tokens=tokens, num_chunks=tokens, status=200))
    return out


def _runs(ttft_s: float, seed: int, errors: int = 0, repeats: int = 2, n: int = 60):
    rng = np.random.default_rng(seed)
    return [_records(n, ttft_s, rng, errors) for _ in range(repeats)]


def _metric(name: str):
    return next(m for m in METRICS if m.name == name)


def _cmp(name: str, base, other, slo: SLO = SLO()):
    c = compare_metric(_metric(name), base, other, slo, n=N_RESAMPLES)
    assert c.low <= c.change <= c.high  # the interval holds the point estimate
    return c


def test_a_clearly_faster_variant_is_better_on_ttft():
    base, fast = _runs(0.200, 1), _runs(0.100, 2)
    c = _cmp("ttft_p50_ms", base, fast)
    assert c.verdict == "better"
    assert c.change == pytest.approx(-0.5, abs=0.1)
    assert c.baseline == pytest.approx(200, rel=0.1) and c.variant == pytest.approx(100, rel=0.1)
    assert c.high < 0
    assert _cmp("ttft_p50_ms", fast, base).verdict == "worse"


def test_the_same_distribution_is_within_noise():
    base, same = _runs(0.200, 1), _runs(0.200, 7)
    for name in ("ttft_p50_ms", "ttft_p90_ms", "e2e_p50_ms", "tpot_p50_ms", "error_fraction",
                 "goodput_fraction", "output_tokens_per_s"):
        c = _cmp(name, base, same, SLO(ttft_ms=220))
        assert c.verdict == "within noise", (name, c)


def test_many_errors_are_worse():
    base, failing = _runs(0.200, 1), _runs(0.200, 3, errors=20)
    c = _cmp("error_fraction", base, failing)
    assert c.verdict == "worse"
    assert c.baseline == 0.0 and c.variant == pytest.approx(20 / 60)
    assert c.change == pytest.approx(20 / 60)  # a fraction: compared by difference
    assert c.low > 0
    g = _cmp("goodput_fraction", base, failing)
    assert g.verdict == "worse" and g.change == pytest.approx(-20 / 60)


def test_goodput_is_compared_by_difference():
    slo = SLO(ttft_ms=150)  # the baseline (160-240 ms) mostly misses, the variant (80-120 ms) always meets
    base, fast = _runs(0.200, 1), _runs(0.100, 2)
    c = _cmp("goodput_fraction", base, fast, slo)
    assert c.variant == 1.0
    assert c.change == pytest.approx(c.variant - c.baseline)
    assert c.verdict == "better"


def test_no_data_when_a_side_has_no_values():
    base = _runs(0.200, 1)
    broken = _runs(0.200, 2, errors=60)
    c = compare_metric(_metric("ttft_p50_ms"), base, broken, SLO(), n=N_RESAMPLES)
    assert c.verdict == "no data"
    assert c.to_json()["change"] is None


# ---- quality --------------------------------------------------------------------------------


def test_run_checks():
    schema = {"type": "object", "required": ["a"], "properties": {"a": {"type": "integer"}}}
    checks = Checks.model_validate({"exact": '{"a": 1}', "regex": r'"a":\s*\d', "json": True, "json_schema": schema})
    assert checks.names() == ["exact", "regex", "json", "json_schema"]
    assert run_checks(checks, '{"a": 1}') == {"exact": True, "regex": True, "json": True, "json_schema": True}
    assert run_checks(checks, '{"a": "x"}') == {"exact": False, "regex": False, "json": True, "json_schema": False}
    assert run_checks(checks, "not json") == {"exact": False, "regex": False, "json": False, "json_schema": False}
    assert run_checks(Checks(), "anything") == {}
    assert run_checks(Checks(regex="^ab"), "abc") == {"regex": True}


def _out(ids, top2=None, error=None, sid="s") -> SampleOutput:
    return SampleOutput(sid, token_ids=list(ids), top2=top2 or [[-0.1, -3.0]] * len(ids), error=error)


def test_compare_identical_near_tie_different_and_error():
    base = _out([1, 2, 3, 4], top2=[[-0.1, -3.0], [-0.1, -3.0], [-0.6930, -0.6935], [-0.1, -3.0]])
    assert compare(base, _out([1, 2, 3, 4])).verdict == "identical"
    flipped = _out([1, 2, 9, 4], top2=[[-0.1, -3.0], [-0.1, -3.0], [-0.6932, -0.6933], [-0.1, -3.0]])
    a = compare(base, flipped)
    assert (a.verdict, a.first_difference) == ("near-tie", 2)
    assert a.top2_gap <= NEAR_TIE
    clear = _out([1, 5, 3, 4])
    b = compare(base, clear)
    assert (b.verdict, b.first_difference) == ("different", 1)
    assert b.top2_gap == pytest.approx(2.9)
    assert compare(base, _out([], error="HTTP 500: boom")).verdict == "error"
    assert compare(_out([], error="timeout"), base).verdict == "error"
    # one output a prefix of the other: they differ where the shorter ends
    c = compare(_out([1, 2, 3, 4]), _out([1, 2]))
    assert (c.verdict, c.first_difference) == ("different", 2)
    assert compare(_out([1, 2, 3], top2=[]), _out([1, 2, 4], top2=[])).verdict == "different"  # no logprobs


def test_sample_output_round_trips():
    out = SampleOutput("x", [1, 2], "hi", [[-0.1, -2.0]], {"regex": True}, None)
    assert SampleOutput.from_json(json.loads(json.dumps(out.to_json()))) == out


def test_request_body_chat_and_completions():
    chat = request_body(Sample(prompt="hello", max_tokens=5), "chat", "m")
    assert chat == {"max_tokens": 5, "temperature": 0.0, "return_token_ids": True, "model": "m",
                    "messages": [{"role": "user", "content": "hello"}], "logprobs": True, "top_logprobs": 2}
    comp = request_body(Sample(prompt="hello"), "completions", None)
    assert comp == {"max_tokens": 32, "temperature": 0.0, "return_token_ids": True, "prompt": "hello",
                    "logprobs": 2}
    one = request_body(Sample(messages=[{"role": "user", "content": "only"}]), "completions", None)
    assert one["prompt"] == "only"
    history = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    flat = request_body(Sample(messages=history), "completions", None)
    assert flat["prompt"] == "system: be brief\nuser: hi\nassistant: "
    assert request_body(Sample(messages=history), "chat", None)["messages"] == history


# ---- recommendation -------------------------------------------------------------------------


def _verdicts(**by_metric) -> dict[str, dict]:
    out = {m.name: {"verdict": "within noise", "change": 0.0} for m in METRICS}
    for name, (verdict, change) in by_metric.items():
        out[name] = {"verdict": verdict, "change": change}
    return out


def _quality(different: int = 0, passes: float = 1.0) -> dict:
    return {"compared": 4, "identical": 4 - different, "near_tie": 0, "different": different, "errors": 0,
            "check_pass_rate": {"regex": passes}}


def test_recommend_adopts_a_variant_better_on_goodput():
    comparisons = {"local": _verdicts(goodput_fraction=("better", 0.2), ttft_p90_ms=("better", -0.3)),
                   "other": _verdicts(ttft_p90_ms=("better", -0.1))}
    rec = recommend(comparisons, {BASELINE: _quality(), "local": _quality(), "other": _quality()})
    assert rec["decision"] == "adopt local" and rec["variant"] == "local"
    assert "goodput_fraction" in rec["evidence"]


def test_recommend_refuses_a_variant_whose_outputs_differ():
    comparisons = {"local": _verdicts(goodput_fraction=("better", 0.2))}
    rec = recommend(comparisons, {BASELINE: _quality(), "local": _quality(different=2)})
    assert rec["variant"] is None and rec["decision"] == "keep the baseline"
    assert "2 quality samples differ" in rec["evidence"]
    rec = recommend(comparisons, {BASELINE: _quality(), "local": _quality(passes=0.5)})
    assert rec["variant"] is None and "regex check pass rate lower" in rec["evidence"]
    worse = {"local": _verdicts(ttft_p90_ms=("better", -0.3), error_fraction=("worse", 0.1))}
    assert recommend(worse, {})["variant"] is None


def test_recommend_keeps_the_baseline_when_nothing_is_better():
    comparisons = {"local": _verdicts(), "disagg": _verdicts(e2e_p90_ms=("worse", 0.2))}
    rec = recommend(comparisons, {})
    assert rec["decision"] == "keep the baseline" and rec["variant"] is None
    assert "local: no gain beyond noise" in rec["evidence"]
    assert "disagg: worse e2e_p90_ms" in rec["evidence"]


def test_top2_from_either_endpoint():
    from cluster.experiment.quality import _top2

    completions = {"top_logprobs": [{"a": -2.0, "b": -0.1, "c": -5.0}, {"x": -0.5}, None]}
    assert _top2(completions, "completions") == [[-0.1, -2.0], [-0.5], []]
    chat = {"content": [{"token": "a", "top_logprobs": [{"token": "a", "logprob": -0.3},
                                                        {"token": "b", "logprob": -0.2}]}]}
    assert _top2(chat, "chat") == [[-0.2, -0.3]]
    assert _top2({}, "chat") == [] and _top2({}, "completions") == []
    # by id (return_token_ids): candidates whose texts collide are both kept
    collided = {"top_logprobs": [{"\ufffd": -0.6931}], "top_logprob_ids": [[[198, -0.6931], [199, -0.6936]]]}
    assert _top2(collided, "completions") == [[-0.6931, -0.6936]]
