"""Workloads: deterministic request lists, built-in or from a user's JSONL/YAML file.

A prompt is ASCII text whose byte length is its target length in tokens. Its token ids
are those bytes, which is exact for pdcluster's byte-level tokenizer and still gives an
exact prompt length on any tokenizer with at least 128 ids (the text just reads as noise
there). The same name, overrides and seed always give byte-identical requests, so two
runs compare the same traffic.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

BUILTIN_NAMES = ("chat-short", "rag-long", "shared-prefix", "multi-turn", "mixed")


def flatten_messages(messages) -> str:
    """A chat history as one completions prompt: the only message's text, or each turn as
    `role: content` on its own line, ending with `assistant: `."""
    if len(messages) == 1:
        return messages[0]["content"]
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. `messages` is the chat form; `prompt` the completions form."""

    request_id: str
    workload: str
    messages: tuple[dict, ...]
    output_len: int
    session_id: str | None = None
    timestamp_s: float | None = None  # only for trace replay

    @property
    def prompt(self) -> str:
        """The completions prompt: the only message's text, or the history flattened."""
        return flatten_messages(self.messages)

    @property
    def prompt_ids(self) -> list[int]:
        return list(self.prompt.encode("utf-8"))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.encode("utf-8"))


@dataclass(frozen=True)
class WorkloadSpec:
    """A generator's parameters; a user YAML file may override any of them.

    Lengths are `[low, high]` token ranges (inclusive, uniform). Defaults suit the tiny CPU
    model (4096-token context); scale them up in a workload file for real models.
    """

    kind: str
    prompt_len: tuple[int, int] = (64, 256)
    output_len: tuple[int, int] = (16, 64)
    prefix_len: int = 512  # shared-prefix: system prompt length
    num_prefixes: int = 4  # shared-prefix: distinct system prompts
    turns: int = 4  # multi-turn: user turns per conversation
    sessions: int = 8  # multi-turn: conversations interleaved at once
    mix: tuple[tuple[str, float], ...] = ()  # mixed: (workload, weight)


DEFAULTS: dict[str, WorkloadSpec] = {
    "chat-short": WorkloadSpec("chat-short", (64, 256), (16, 64)),
    "rag-long": WorkloadSpec("rag-long", (1024, 2048), (16, 32)),
    "shared-prefix": WorkloadSpec("shared-prefix", (32, 96), (16, 32), prefix_len=512),
    "multi-turn": WorkloadSpec("multi-turn", (32, 96), (16, 48), turns=4, sessions=8),
    "mixed": WorkloadSpec(
        "mixed", mix=(("chat-short", 0.5), ("rag-long", 0.2), ("shared-prefix", 0.2), ("multi-turn", 0.1))
    ),
}

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def make_text(rng: random.Random, num_bytes: int) -> str:
    """Pseudo-words of exactly `num_bytes` ASCII bytes."""
    words, size = [], 0
    while size < num_bytes:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9)))
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:num_bytes].ljust(num_bytes, "x")


def _length(rng: random.Random, bounds: tuple[int, int]) -> int:
    return rng.randint(bounds[0], bounds[1])


def _user(content: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": content},)


def _single(spec: WorkloadSpec, seed: int) -> Iterator[RequestSpec]:
    rng = random.Random(f"{spec.kind}:{seed}")
    for i in itertools.count():
        text = make_text(rng, _length(rng, spec.prompt_len))
        yield RequestSpec(f"{spec.kind}-{i}", spec.kind, _user(text), _length(rng, spec.output_len))


def _shared_prefix(spec: WorkloadSpec, seed: int) -> Iterator[RequestSpec]:
    rng = random.Random(f"{spec.kind}:{seed}")
    prefixes = [make_text(rng, spec.prefix_len) for _ in range(spec.num_prefixes)]
    for i in itertools.count():
        system = {"role": "system", "content": prefixes[rng.randrange(len(prefixes))]}
        suffix = make_text(rng, _length(rng, spec.prompt_len))
        messages = (system, {"role": "user", "content": suffix})
        yield RequestSpec(f"{spec.kind}-{i}", spec.kind, messages, _length(rng, spec.output_len))


def _multi_turn(spec: WorkloadSpec, seed: int) -> Iterator[RequestSpec]:
    """Groups of `sessions` conversations, sent turn by turn, round robin, so a session's
    next turn comes `sessions` requests later with the whole history before it. The
    assistant turns in the history are synthetic (fixed by the seed), not the server's."""
    rng = random.Random(f"{spec.kind}:{seed}")
    for group in itertools.count():
        histories: list[list[dict]] = [[] for _ in range(spec.sessions)]
        for turn in range(spec.turns):
            for s, history in enumerate(histories):
                history.append({"role": "user", "content": make_text(rng, _length(rng, spec.prompt_len))})
                output_len = _length(rng, spec.output_len)
                session_id = f"{spec.kind}-s{group * spec.sessions + s}"
                yield RequestSpec(f"{session_id}-t{turn}", spec.kind, tuple(history), output_len, session_id)
                history.append({"role": "assistant", "content": make_text(rng, output_len)})


def _mixed(spec: WorkloadSpec, seed: int, overrides: dict) -> Iterator[RequestSpec]:
    rng = random.Random(f"{spec.kind}:{seed}")
    names = [name for name, _ in spec.mix]
    weights = [weight for _, weight in spec.mix]
    sources = {name: iter_builtin(name, seed, overrides.get(name, {})) for name in names}
    for i in itertools.count():
        inner = next(sources[rng.choices(names, weights)[0]])
        yield replace(inner, request_id=f"mixed-{i}:{inner.request_id}")


def iter_builtin(name: str, seed: int, overrides: dict | None = None) -> Iterator[RequestSpec]:
    """An endless, deterministic stream of one built-in workload's requests."""
    if name not in DEFAULTS:
        raise ValueError(f"unknown workload {name!r}; built-ins: {', '.join(BUILTIN_NAMES)}")
    overrides = dict(overrides or {})
    nested = {k: overrides.pop(k) for k in list(overrides) if k in DEFAULTS}
    spec = _override(DEFAULTS[name], overrides)
    if name == "mixed":
        return _mixed(spec, seed, nested)
    if name == "shared-prefix":
        return _shared_prefix(spec, seed)
    if name == "multi-turn":
        return _multi_turn(spec, seed)
    return _single(spec, seed)


def _override(spec: WorkloadSpec, overrides: dict) -> WorkloadSpec:
    known = set(WorkloadSpec.__dataclass_fields__) - {"kind"}
    for key in overrides:
        if key not in known:
            raise ValueError(f"workload file: unknown key {key!r}; expected one of {sorted(known)}")
    fixed = {k: _as_range(v) if k in ("prompt_len", "output_len") else v for k, v in overrides.items()}
    if "mix" in fixed:
        fixed["mix"] = tuple((m["workload"], float(m.get("weight", 1.0))) for m in fixed["mix"])
    return replace(spec, **fixed)


def _as_range(value) -> tuple[int, int]:
    if isinstance(value, int):
        return (value, value)
    low, high = value
    if not 1 <= int(low) <= int(high):
        raise ValueError(f"workload file: bad length range {value!r}")
    return (int(low), int(high))


# ---- user files -------------------------------------------------------------------------


@dataclass
class FileWorkload:
    """Requests listed in a file; the run cycles through them when it needs more."""

    name: str
    specs: list[RequestSpec] = field(default_factory=list)

    def __iter__(self) -> Iterator[RequestSpec]:
        for lap in itertools.count():
            for spec in self.specs:
                yield spec if lap == 0 else replace(spec, request_id=f"{spec.request_id}#{lap}")


def request_from_row(row: dict, index: int, name: str, seed: int) -> RequestSpec:
    """One file row: `prompt` (text) or `messages` or `prompt_len` (synthetic text), plus
    `output_len` (alias `max_tokens`), optional `id`, `session_id`, `timestamp`, and
    `workload` (the request's `x-workload`, so one trace can mix workload profiles;
    default: the file's name). The synthetic text depends on `name`, never on `workload`."""
    rng = random.Random(f"{name}:{seed}:{index}")
    if "messages" in row:
        messages = tuple({"role": m["role"], "content": m["content"]} for m in row["messages"])
    elif "prompt" in row:
        messages = _user(str(row["prompt"]))
    elif "prompt_len" in row:
        messages = _user(make_text(rng, int(row["prompt_len"])))
    else:
        raise ValueError(f"{name} row {index}: needs 'prompt', 'messages' or 'prompt_len'")
    output_len = int(row.get("output_len", row.get("max_tokens", 32)))
    timestamp = row.get("timestamp")
    return RequestSpec(
        str(row.get("id", f"{name}-{index}")), str(row.get("workload", name)), messages, output_len,
        row.get("session_id"), None if timestamp is None else float(timestamp),
    )


def load_file(path: Path, seed: int) -> Iterator[RequestSpec]:
    """JSONL (one request per line) or YAML: a list of requests, or a generator mapping
    `{workload: NAME, <WorkloadSpec overrides>}`."""
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text)
    else:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        overrides = dict(data)
        base = overrides.pop("workload", None)
        if base is None:
            raise ValueError(f"{path}: a generator mapping needs 'workload: NAME'")
        return iter_builtin(base, seed, overrides)
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty list of requests or a generator mapping")
    return iter(FileWorkload(path.stem, [request_from_row(r, i, path.stem, seed) for i, r in enumerate(data)]))


def iter_workload(name_or_path: str, seed: int) -> Iterator[RequestSpec]:
    """Built-in name or a file path: an endless deterministic stream of requests."""
    if name_or_path in DEFAULTS:
        return iter_builtin(name_or_path, seed)
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"workload {name_or_path!r} is neither a built-in ({', '.join(BUILTIN_NAMES)}) nor a file")
    return load_file(path, seed)


def take(name_or_path: str, seed: int, n: int) -> list[RequestSpec]:
    return list(itertools.islice(iter_workload(name_or_path, seed), n))
