"""Output quality on a fixed sample set: each sample sent greedily under every variant,
its token ids compared with the baseline's, and its checks (exact text, regex, JSON,
JSON schema) run on the text.

A route or batching change must not change a greedy output. When one does, the sample's
logprobs tell a near-tie flip (the top two candidates within `NEAR_TIE` at the first
differing token, which a different batch composition can legitimately flip on GPUs)
from a real difference.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from cluster.experiment.spec import Checks, Sample
from cluster.loadtest.workloads import flatten_messages

NEAR_TIE = 1e-3
TOP_LOGPROBS = 2


@dataclass
class SampleOutput:
    sample_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    top2: list[list[float]] = field(default_factory=list)  # per generated token, its two best logprobs
    checks: dict[str, bool] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> SampleOutput:
        return cls(**row)


def sample_id(sample: Sample, index: int) -> str:
    return sample.id or f"sample-{index}"


def request_body(sample: Sample, endpoint: str, model: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": sample.max_tokens, "temperature": 0.0, "return_token_ids": True}
    if model:
        body["model"] = model
    if endpoint == "chat":
        body["messages"] = sample.messages or [{"role": "user", "content": sample.prompt}]
        body.update(logprobs=True, top_logprobs=TOP_LOGPROBS)
    else:
        body["prompt"] = sample.prompt if sample.prompt is not None else flatten_messages(sample.messages or [])
        body["logprobs"] = TOP_LOGPROBS
    return body


def send(http: httpx.Client, url: str, sample: Sample, index: int, endpoint: str, model: str | None,
         headers: dict[str, str]) -> SampleOutput:
    out = SampleOutput(sample_id(sample, index))
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    try:
        response = http.post(url + path, json=request_body(sample, endpoint, model),
                             headers={**headers, "x-request-id": f"quality-{out.sample_id}"})
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    if response.status_code != 200:
        out.error = f"HTTP {response.status_code}: {response.text[:200]}"
        return out
    choice = response.json()["choices"][0]
    out.token_ids = list(choice.get("token_ids") or [])
    out.text = (choice.get("message") or {}).get("content") or "" if endpoint == "chat" else choice.get("text", "")
    out.top2 = _top2(choice.get("logprobs") or {}, endpoint)
    out.checks = run_checks(sample.checks, out.text)
    return out


def _top2(logprobs: dict[str, Any], endpoint: str) -> list[list[float]]:
    if endpoint == "chat":
        tops = [[t["logprob"] for t in entry.get("top_logprobs") or ()] for entry in logprobs.get("content") or ()]
    elif logprobs.get("top_logprob_ids") is not None:  # pdcluster's extension: candidates by id
        tops = [[lp for _, lp in entry or ()] for entry in logprobs["top_logprob_ids"]]
    else:  # by text: candidates with equal texts share one entry
        tops = [list((entry or {}).values()) for entry in logprobs.get("top_logprobs") or ()]
    return [sorted(values, reverse=True)[:TOP_LOGPROBS] for values in tops]


def run_checks(checks: Checks, text: str) -> dict[str, bool]:
    results: dict[str, bool] = {}
    if checks.exact is not None:
        results["exact"] = text == checks.exact
    if checks.regex is not None:
        results["regex"] = re.search(checks.regex, text) is not None
    parsed, parses = None, False
    if checks.json_ or checks.json_schema is not None:
        try:
            parsed, parses = json.loads(text), True
        except ValueError:
            parses = False
    if checks.json_:
        results["json"] = parses
    if checks.json_schema is not None:
        results["json_schema"] = parses and _valid(parsed, checks.json_schema)
    return results


def _valid(value: Any, schema: dict[str, Any]) -> bool:
    import jsonschema

    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return False
    return True


@dataclass(frozen=True)
class Agreement:
    """One sample under a variant against the same sample under the baseline."""

    sample_id: str
    verdict: str  # identical | near-tie | different | error
    first_difference: int | None = None
    top2_gap: float | None = None  # at the first difference: the smaller of the two runs' top-2 gaps


def compare(base: SampleOutput, other: SampleOutput) -> Agreement:
    if base.error or other.error:
        return Agreement(base.sample_id, "error")
    if base.token_ids == other.token_ids:
        return Agreement(base.sample_id, "identical")
    i = next((k for k, (a, b) in enumerate(zip(base.token_ids, other.token_ids, strict=False)) if a != b),
             min(len(base.token_ids), len(other.token_ids)))
    gaps = [top[0] - top[1] for top in (_at(base.top2, i), _at(other.top2, i)) if len(top) >= 2]
    gap = min(gaps) if gaps else None
    verdict = "near-tie" if gap is not None and gap <= NEAR_TIE else "different"
    return Agreement(base.sample_id, verdict, i, gap)


def _at(tops: list[list[float]], i: int) -> list[float]:
    return tops[i] if i < len(tops) else []
