"""The Router's OpenAI-compatible API as the official `openai` client and lm-eval see it,
on the app of tests/router_http/support.py: fields refused or accepted, limits, prompt
lists, logprobs equal to transformers', penalties, JSON schemas and n choices, on both
routes.
"""

from __future__ import annotations

import json

import pytest

from tests.router_http.support import (
    MAX_TOKENS_LIMIT,
    assert_openai_error,
    sum_by,
)


@pytest.fixture(scope="module")
def oai(client):
    import openai

    with openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def _bad_request(call, param):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        call()
    error = info.value.body
    assert error["param"] == param and param in error["message"], error
    return error


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("field", "value"), [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"), ("audio", {"voice": "x", "format": "wav"}),
    ("modalities", ["text", "audio"]), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "high")])
def test_chat_fields_that_would_change_the_output_are_refused(oai, field, value):
    _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                     extra_body={field: value}), field)


def test_completion_suffix_refused_and_harmless_fields_accepted(oai):
    _bad_request(lambda: oai.completions.create(model="tiny", prompt="x", suffix="y", max_tokens=1), "suffix")
    out = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1, user="u", metadata={"a": "b"},
                                      store=False, tool_choice="none", parallel_tool_calls=False)
    assert len(out.choices) == 1


def test_limits_and_missing_content_are_400s(oai):
    over = MAX_TOKENS_LIMIT + 1
    _bad_request(lambda: oai.completions.create(model="tiny", prompt="x", max_tokens=over), "max_tokens")
    _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=over),
                 "max_completion_tokens")
    error = _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=[{"role": "user"}]),
                         "messages.0.content")
    assert error["type"] == "invalid_request_error"


def test_tokenize_detokenize_round_trip(client):
    tokens = client.post("/tokenize", json={"model": "tiny", "prompt": "héllo"}).json()
    assert tokens["count"] == len(tokens["tokens"]) == len("héllo".encode()) and tokens["max_model_len"] > 0
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    chat = client.post("/tokenize", json={"messages": CHAT}).json()
    with_prompt = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1,
                                                            "return_token_ids": True}).json()
    assert chat["tokens"] == with_prompt["prompt_token_ids"]
    assert_openai_error(client.post("/detokenize", json={"tokens": [10**7]}), 400)
    assert_openai_error(client.post("/tokenize", json={"prompt": "x", "messages": CHAT}), 400)


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_prompt_lists_give_one_choice_per_prompt_in_order(oai, mode):
    prompts = ["first prompt, long enough to go anywhere " * 2, "second " * 9, "a third one " * 6]
    one_by_one = [oai.completions.create(model="tiny", prompt=p, max_tokens=3, temperature=0,
                                         extra_headers={"x-pd-mode": mode}).choices[0].text for p in prompts]
    batch = oai.completions.create(model="tiny", prompt=prompts, max_tokens=3, temperature=0,
                                   extra_headers={"x-pd-mode": mode})
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == one_by_one
    by_ids = oai.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0,
                                    extra_headers={"x-pd-mode": mode})
    assert len(by_ids.choices) == 2 and by_ids.usage.prompt_tokens == 5


def _transformers_logprobs(model_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_echo_with_logprobs_as_lm_eval_reads_it(oai, tiny_model_dir, mode):
    """lm-eval's local-completions: token-id prompts, echo, max_tokens 1, logprobs 1; it reads
    token_logprobs[ctxlen:-1] and top_logprobs[ctxlen:-1] of each choice."""
    prompts = [[72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100] * 3, [84, 104, 101, 32, 99, 97, 116]]
    out = oai.completions.create(model="tiny", prompt=prompts, echo=True, max_tokens=1, logprobs=1,
                                 temperature=0, extra_headers={"x-pd-mode": mode})
    for choice, ids in zip(out.choices, prompts, strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert choice.text.startswith(bytes(ids).decode())
        expected = _transformers_logprobs(tiny_model_dir, ids)
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - expected[i - 1, ids[i]].item()) < 1e-4
            assert len(lp.top_logprobs[i]) >= 1
    # A cached prefix must not leave gaps: the same prompt again (now in the prefix cache)
    # returns every prompt logprob, unchanged.
    again = oai.completions.create(model="tiny", prompt=prompts[0], echo=True, max_tokens=1, logprobs=1,
                                   temperature=0, extra_headers={"x-pd-mode": mode})
    assert again.choices[0].logprobs.token_logprobs[:len(prompts[0])] == \
        out.choices[0].logprobs.token_logprobs[:len(prompts[0])]
    only_prompt = oai.completions.create(model="tiny", prompt="echo me", echo=True, max_tokens=0,
                                         extra_headers={"x-pd-mode": mode})
    assert only_prompt.choices[0].text == "echo me" and only_prompt.usage.completion_tokens == 0


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_generated_logprobs_shapes(oai, mode):
    text = oai.completions.create(model="tiny", prompt="shapes of logprobs " * 3, max_tokens=3, logprobs=2,
                                  temperature=0, extra_headers={"x-pd-mode": mode}).choices[0]
    assert len(text.logprobs.tokens) == len(text.logprobs.token_logprobs) == 3
    assert all(len(top) >= 1 for top in text.logprobs.top_logprobs)
    assert "".join(text.logprobs.tokens) == text.text or text.finish_reason == "stop"
    chat = oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=3, logprobs=True, top_logprobs=2,
                                       temperature=0, extra_headers={"x-pd-mode": mode}).choices[0]
    content = chat.logprobs.content
    assert len(content) >= 1 and all(len(t.top_logprobs) == 2 and t.bytes for t in content)
    assert content[0].top_logprobs[0].logprob >= content[0].top_logprobs[1].logprob
    stream = oai.completions.create(model="tiny", prompt="shapes of logprobs " * 3, max_tokens=3, logprobs=2,
                                    temperature=0, stream=True, extra_headers={"x-pd-mode": mode})
    parts = [c for part in stream for c in part.choices if c.logprobs]
    streamed = [lp for c in parts for lp in c.logprobs.token_logprobs]
    # The same tokens; the values within float32 rounding: the first request's prompt was
    # attended whole by the causal kernel, the repeat finds it in the prefix cache and
    # attends its last block through the masked one, which sums in another order.
    assert [t for c in parts for t in c.logprobs.tokens] == text.logprobs.tokens
    assert streamed == pytest.approx(text.logprobs.token_logprobs, abs=1e-5)


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_generated_logprobs_equal_transformers(oai, client, tiny_model_dir, mode):
    """Each generated token's logprob and its top alternatives are transformers'
    log-softmax at that position (fp32), whichever route prefilled the prompt."""
    prompt = "logprobs of what comes next " * 2
    ids = client.post("/tokenize", json={"model": "tiny", "prompt": prompt}).json()["tokens"]
    out = oai.completions.create(model="tiny", prompt=prompt, max_tokens=5, logprobs=3, temperature=0,
                                 extra_headers={"x-pd-mode": mode}).choices[0]
    token_ids = _generated_ids(client, prompt, mode)
    expected = _transformers_logprobs(tiny_model_dir, ids + token_ids)
    assert len(out.logprobs.token_logprobs) == len(token_ids)
    for i, (token_id, logprob) in enumerate(zip(token_ids, out.logprobs.token_logprobs, strict=True)):
        row = expected[len(ids) + i - 1]
        assert abs(logprob - row[token_id].item()) < 1e-4
        # Keyed by token text: tokens with the same text share a key (the most likely kept).
        top = sorted(out.logprobs.top_logprobs[i].values(), reverse=True)
        true_top = row.topk(3).values.tolist()
        assert top[0] == pytest.approx(true_top[0], abs=1e-4)
        assert all(min(abs(v - t) for t in true_top) < 1e-4 for v in top)


def _generated_ids(client, prompt: str, mode: str) -> list[int]:
    r = client.post("/v1/completions", headers={"x-pd-mode": mode},
                    json={"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0,
                          "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_response_format_json_schema_holds_or_is_a_400(oai, mode):
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}, "required": ["a"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema, "strict": True}}
    out = oai.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=6, seed=1,
                                      response_format=fmt, extra_headers={"x-pd-mode": mode}).choices[0]
    if out.finish_reason == "stop":
        assert set(json.loads(out.message.content)) == {"a"}
    bad = {"type": "json_schema", "json_schema": {"name": "o", "schema": {"type": "nonsense"}}}
    _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                     response_format=bad), "response_format")


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_lm_eval_loglikelihoods_match_transformers(client, tiny_model_dir, tmp_path, mode):
    """lm-eval-harness's `local-completions` runs a multiple-choice task against the server;
    its loglikelihoods equal transformers' own on both routes."""
    from tests.lm_eval_support import reference_loglikelihoods, served_loglikelihoods, write_task

    served = served_loglikelihoods(str(client.base_url), tiny_model_dir.name, tiny_model_dir,
                                   write_task(tmp_path / "task"), {"x-pd-mode": mode})
    reference = reference_loglikelihoods(tiny_model_dir)
    assert [len(row) for row in served] == [len(row) for row in reference]
    for got, want in zip(served, reference, strict=True):
        assert got == pytest.approx(want, abs=1e-3)


# ---- n > 1, penalties and structured outputs on both routes -----------------------------


def _prompt_tokens_computed(client) -> dict[str, float]:
    """Prompt tokens computed per pool, by every replica up to this call (`fresh`)."""
    r = client.get("/metrics", params={"fresh": "true"})
    assert r.headers["x-pdc-stale-sources"] == "0"
    return sum_by(r.text, "pdc_prompt_tokens_computed_total", "pool")


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_n_choices_are_seeded_singles_and_the_prompt_is_prefilled_once(client, mode):
    """n = 3: choice i is what an n = 1 request with seed + i returns; usage counts the prompt
    once and every generated token; the prompt is computed once, by the pool that prefills."""
    prompt = f"{mode}: a fresh prompt for three sampled continuations, prefilled only once"
    body = {"prompt": prompt, "temperature": 1.0, "seed": 1234, "max_tokens": 8, "return_token_ids": True}
    before = _prompt_tokens_computed(client)
    r = client.post("/v1/completions", json={**body, "n": 3}, headers={"x-pd-mode": mode})
    assert r.status_code == 200, r.text
    assert r.headers["x-pd-route"] == mode
    out = r.json()
    num_prompt_tokens = len(out["prompt_token_ids"])
    pool = "prefill" if mode == "disagg" else "decode"
    after = _prompt_tokens_computed(client)
    computed = {p: after.get(p, 0) - before.get(p, 0) for p in ("prefill", "decode")}
    assert computed[pool] == num_prompt_tokens and sum(computed.values()) == num_prompt_tokens, computed
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["usage"]["prompt_tokens"] == num_prompt_tokens
    assert out["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in out["choices"])
    for i, choice in enumerate(out["choices"]):
        single = client.post("/v1/completions", json={**body, "seed": 1234 + i}, headers={"x-pd-mode": mode})
        expected = single.json()["choices"][0]
        assert (choice["token_ids"], choice["text"], choice["finish_reason"]) == \
            (expected["token_ids"], expected["text"], expected["finish_reason"]), i
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1  # the seeds differ, so do the samples


@pytest.fixture(scope="module")
def hf_tiny(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), torch_dtype=torch.float32).eval()


PENALTIES = [dict(frequency_penalty=1.5), dict(presence_penalty=2.0, frequency_penalty=-0.3),
             dict(repetition_penalty=1.8)]


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_penalties_over_http_follow_the_reference_formulas(client, hf_tiny, mode):
    """Greedy with each penalty gives, token for token, what OpenAI's formula (HF's for the
    repetition penalty) applied to transformers' logits predicts; logit_bias +100 forces a token."""
    from tests.test_penalties import reference_greedy
    from workers.engine import SamplingParams

    prompt = list(b"abababababab cdcdcd")  # every penalty below changes its greedy output
    body = {"prompt": prompt, "temperature": 0, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    headers = {"x-pd-mode": mode}

    def served(**extra) -> list[int]:
        r = client.post("/v1/completions", json={**body, **extra}, headers=headers)
        assert r.status_code == 200 and r.headers["x-pd-route"] == mode, r.text
        return r.json()["choices"][0]["token_ids"]

    plain = served()
    for penalty in PENALTIES:
        expected = reference_greedy(hf_tiny, prompt, SamplingParams(max_tokens=12, temperature=0.0, **penalty))
        assert served(**penalty) == expected, penalty
        assert expected != plain, f"{penalty} changed nothing: the check proves nothing"
    assert served(logit_bias={"42": 100}) == [42] * 12


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "size", "tags", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("mode", ["local", "disagg"])
def test_json_schema_holds_for_50_seeded_samples(oai, mode):
    """Seeds 0..49 at temperature 1 (n = 10 from five seed bases): every output that stops
    validates; one cut by max_tokens says `length`; json_object gives an object."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    def sample(seed_base: int, fmt=JSON_SCHEMA_FORMAT, max_tokens=MAX_TOKENS_LIMIT):
        raw = oai.chat.completions.with_raw_response.create(
            model="tiny", messages=CHAT, n=10, seed=seed_base, temperature=1.0, max_completion_tokens=max_tokens,
            response_format=fmt, extra_headers={"x-pd-mode": mode})
        assert raw.headers["x-pd-route"] == mode
        return raw.parse().choices

    with ThreadPoolExecutor(5) as pool:
        choices = [c for batch in pool.map(sample, range(0, 50, 10)) for c in batch]
    assert len(choices) == 50
    stopped = [c for c in choices if c.finish_reason == "stop"]
    assert {c.finish_reason for c in choices} <= {"stop", "length"}
    assert len(stopped) >= 25, [c.message.content for c in choices if c.finish_reason != "stop"]
    for c in stopped:
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    cut = sample(0, max_tokens=5)
    assert {c.finish_reason for c in cut} == {"length"}
    objects = sample(100, fmt={"type": "json_object"})
    assert all(isinstance(json.loads(c.message.content), dict) for c in objects if c.finish_reason == "stop")


def test_unsupported_schemas_and_streamed_best_of_are_400s(oai):
    no_schema = {"type": "json_schema"}
    _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                     response_format=no_schema), "response_format.json_schema")
    unique = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}}
    error = _bad_request(lambda: oai.chat.completions.create(model="tiny", messages=CHAT, max_tokens=1,
                                                             response_format=unique), "response_format")
    assert "uniqueItems" in error["message"]
    _bad_request(lambda: oai.completions.create(model="tiny", prompt="x", max_tokens=2, n=1, best_of=2,
                                                stream=True), "best_of")
