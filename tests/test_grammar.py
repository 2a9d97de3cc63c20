"""Structured outputs on the tiny random-weight model: without a grammar it emits junk, so
every output that ends with "stop" being valid is the grammar's doing. Both routes (local,
and prefill engine -> KV -> decode engine in process) give the same tokens."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.engine_support import make_engine_fixture  # noqa: F401
from tests.test_engine_kv_transfer import import_kv, prefill_remotely
from workers.engine import SamplingParams
from workers.engine.grammar import GrammarCompiler, mask_disallowed
from workers.engine.grammar_text import validate_guided
from workers.engine.sampler import SamplingRow
from workers.engine.sampling_params import GuidedDecoding
from workers.model_files import build_tokenizer

# Strings and arrays are bounded so that a random-weight model always finishes.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
JSON_SCHEMA = GuidedDecoding("json_schema", json.dumps(SCHEMA))
PROMPT = list(b"Reply in JSON: ")
NUM_SAMPLES = 50


def sampled_and_greedy(guided: GuidedDecoding, num: int, max_tokens: int = 160) -> list[SamplingParams]:
    return ([SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, guided=guided) for i in range(num)]
            + [SamplingParams(max_tokens=max_tokens, temperature=0.0, guided=guided)])


def texts(engine, outputs) -> list[str]:
    """The text of every output that ended with "stop" (EOS excluded)."""
    eos = engine.eos_token_ids
    return [engine.tokenizer.decode([t for t in o.token_ids if t not in eos])
            for o in outputs if o.finish_reason == "stop"]


def run_disaggregated(make_engine, params: list[SamplingParams]) -> list:
    """Prefill every request on one engine (first token sampled there, under the grammar),
    hand the KV to another, and decode there."""
    prefill, decode = make_engine(), make_engine()
    sinks = [prefill_remotely(prefill, PROMPT, p, seed=p.seed or 0) for p in params]
    for i, (p, sink) in enumerate(zip(params, sinks, strict=True)):
        reservation = import_kv(decode, f"t{i}", PROMPT, sink)
        decode.commit_kv(reservation, f"d{i}", p, sink.first_token_id, seed=p.seed or 0)
    final = {}
    while decode.has_unfinished_requests():
        final.update((o.request_id, o) for o in decode.step() if o.finished)
    return [final[f"d{i}"] for i in range(len(params))]


def test_json_schema_outputs_validate_on_both_routes_and_agree(make_engine):
    params = sampled_and_greedy(JSON_SCHEMA, NUM_SAMPLES)
    local_engine = make_engine()
    local = local_engine.generate([PROMPT] * len(params), params)
    assert sum(o.finish_reason == "stop" for o in local) >= NUM_SAMPLES // 2, "too few outputs finished"
    for text in texts(local_engine, local):
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len({tuple(o.token_ids) for o in local}) > NUM_SAMPLES // 2, "seeds should give different outputs"

    remote = run_disaggregated(make_engine, params)
    assert [o.token_ids for o in remote] == [o.token_ids for o in local]
    assert [o.finish_reason for o in remote] == [o.finish_reason for o in local]


def test_json_object_regex_and_choice(make_engine):
    engine = make_engine()
    cases = {
        GuidedDecoding("json_object"): lambda text: isinstance(json.loads(text), dict),
        GuidedDecoding("regex", r"[0-9]{3}-[a-z]{2,5}"): lambda text: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", text),
        GuidedDecoding("choice", json.dumps(["yes", "no", 'a "quoted" é'])):
            lambda text: text in ("yes", "no", 'a "quoted" é'),
    }
    for guided, check in cases.items():
        outputs = engine.generate([PROMPT] * 11, sampled_and_greedy(guided, 10, max_tokens=64))
        finished = texts(engine, outputs)
        assert finished, f"{guided.kind}: no output finished"
        assert all(check(text) for text in finished), (guided.kind, finished)


def test_greedy_choice_is_identical_across_routes(make_engine):
    params = [SamplingParams(max_tokens=16, temperature=0.0, guided=GuidedDecoding("choice", '["alpha", "beta"]'))]
    local = make_engine().generate([PROMPT], params)
    assert local[0].finish_reason == "stop"
    assert [o.token_ids for o in run_disaggregated(make_engine, params)] == [local[0].token_ids]


def test_forked_sequences_keep_the_grammar_and_their_seeds(make_engine):
    """n = 3 under a grammar: every sequence's first token is sampled under the mask its
    parent's was, so each is a valid choice and equals the n = 1 run with seed + i."""
    guided = GuidedDecoding("choice", json.dumps(["alpha", "beta", "gamma", "delta"]))
    engine = make_engine()
    forked = engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=7, n=3, guided=guided))
    singles = [engine.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=7 + i,
                                                        guided=guided))[0] for i in range(3)]
    assert [o.token_ids for o in forked] == [o.token_ids for o in singles]
    assert all(o.finish_reason == "stop" for o in forked)
    assert set(texts(engine, forked)) <= {"alpha", "beta", "gamma", "delta"}


def test_max_tokens_cuts_a_guided_output_with_length(make_engine):
    out = make_engine().generate([PROMPT], [SamplingParams(max_tokens=5, temperature=0.0, guided=JSON_SCHEMA)])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5


def test_preemption_does_not_advance_the_grammar_twice(make_engine):
    params = sampled_and_greedy(JSON_SCHEMA, 3, max_tokens=100)
    expected = make_engine().generate([PROMPT] * len(params), params)
    engine = make_engine(num_kv_blocks=30, block_size=4)  # room for one sequence, not four
    got = engine.generate([PROMPT] * len(params), params)
    assert engine.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


@pytest.mark.parametrize(("guided", "problem"), [
    (GuidedDecoding("json_schema", '{"type": "strnig"}'), "strnig"),
    (GuidedDecoding("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (GuidedDecoding("json_schema", '{"type": '), "not valid JSON"),
    (GuidedDecoding("json_schema", "[1]"), "must be a JSON object"),
    (GuidedDecoding("regex", "a(b"), "unclosed group"),
    (GuidedDecoding("choice", '["a", ""]'), "must not be empty"),
])
def test_invalid_specs_raise_value_error_naming_the_problem(guided, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        validate_guided(guided, build_tokenizer())


def test_validation_is_cached_and_engine_refuses_invalid_guided(make_engine):
    tokenizer = build_tokenizer()
    validate_guided(JSON_SCHEMA, tokenizer)
    validate_guided(JSON_SCHEMA, tokenizer)  # answered from the cache
    engine = make_engine()
    with pytest.raises(ValueError, match="uniqueItems"):
        engine.add_request("r", PROMPT, SamplingParams(guided=GuidedDecoding("json_schema", '{"uniqueItems": true}')))
    assert not engine.has_unfinished_requests()


def test_matcher_mask_pads_the_model_vocab_and_forks():
    compiler = GrammarCompiler(build_tokenizer(), vocab_size=300, eos_token_ids=frozenset({258}))
    matcher = compiler.matcher(GuidedDecoding("choice", '["ab", "ac"]'))
    assert matcher.allowed().shape == (300,)
    assert matcher.allowed().nonzero().flatten().tolist() == [ord("a")]
    matcher.accept(ord("a"))
    child = matcher.fork()
    assert matcher.allowed().nonzero().flatten().tolist() == [ord("b"), ord("c")]
    matcher.accept(ord("b"))
    assert matcher.is_terminated() and matcher.allowed().nonzero().flatten().tolist() == [258]
    assert not child.is_terminated()  # a fork moves on its own
    matcher.rollback(1)
    assert not matcher.is_terminated()
    with pytest.raises(ValueError, match="outside the grammar"):
        child.accept(ord("z"))


def test_mask_disallowed_leaves_its_input_and_unguided_rows_alone():
    logits = torch.zeros(2, 4)
    allowed = torch.tensor([False, True, False, False])
    rows = [SamplingRow(SamplingParams(), 0, 0, frozenset(), allowed=allowed), SamplingRow(SamplingParams(), 0, 0, frozenset())]
    masked = mask_disallowed(logits, rows)
    assert masked[0].tolist() == [float("-inf"), 0.0, float("-inf"), float("-inf")]
    assert masked[1].tolist() == [0.0] * 4 and logits.eq(0).all()
