"""`pdcluster bench api`: what the OpenAI-API sampling features cost the engine.

One offline `LLMEngine` (fp32, CPU, prefix caching off so every run computes its prompts)
runs one workload (the seeded prompts and lengths of `bench engine`) in five
configurations: plain seeded sampling, `logprobs: 5`, penalties with a logit bias,
`n: 4`, and a JSON schema. Each is warmed up untimed; then, per repeat, all five run in
turn (A B C D E, A B C D E, ...), so a shared machine's drift weighs on all alike.
Figures are medians over repeats of generated tokens per second (every sequence's tokens;
for the JSON schema those actually generated, up to its end).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from cluster.bench.engine import (
    DEFAULT_MODEL_CACHE,
    BenchConfig,
    Log,
    Workload,
    make_workload,
    warmup_workload,
)

# Strings and the array are bounded so a random-weight model always closes the object.
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
        "city": {"type": "string", "maxLength": 10},
    },
    "required": ["name", "age", "tags", "city"],
    "additionalProperties": False,
}
JSON_MAX_TOKENS = 160  # room for the longest object the schema allows, in byte tokens
LOGIT_BIAS = ((32, 2.0), (101, 1.0), (116, -1.0), (255, -100.0))
CONFIGS = ("plain", "logprobs", "penalties", "n4", "json_schema")
TARGETS = {"logprobs_vs_plain": 0.9, "penalties_vs_plain": 0.9, "json_schema_vs_plain": 0.8}


@dataclass(frozen=True)
class ApiBenchConfig:
    preset: str = "small"
    num_requests: int = 16
    repeats: int = 7
    seed: int = 0
    prompt_len_range: tuple[int, int] = (32, 256)
    output_len_range: tuple[int, int] = (16, 64)
    max_num_batched_tokens: int = 1024
    model_cache: Path = DEFAULT_MODEL_CACHE

    def workload(self) -> Workload:
        return make_workload(BenchConfig(num_requests=self.num_requests, seed=self.seed,
                                         prompt_len_range=self.prompt_len_range,
                                         output_len_range=self.output_len_range))


def sampling_params(config: str, output_len: int, seed: int):
    """The request of one configuration: seeded temperature-1 sampling plus its feature."""
    from workers.engine.sampling_params import GuidedDecoding, SamplingParams

    plain = SamplingParams(max_tokens=output_len, temperature=1.0, seed=seed, ignore_eos=True)
    if config == "plain":
        return plain
    if config == "logprobs":
        return replace(plain, logprobs=5)
    if config == "penalties":
        return replace(plain, frequency_penalty=0.5, presence_penalty=0.5, repetition_penalty=1.1,
                       logit_bias=LOGIT_BIAS)
    if config == "n4":
        return replace(plain, n=4)
    if config == "json_schema":
        return replace(plain, max_tokens=JSON_MAX_TOKENS, ignore_eos=False,
                       guided=GuidedDecoding("json_schema", json.dumps(JSON_SCHEMA)))
    raise ValueError(f"unknown configuration {config!r}")


@dataclass
class Run:
    num_generated_tokens: int
    num_prompt_tokens_computed: int
    num_preemptions: int
    num_cut_at_max_tokens: int  # for the JSON schema: objects left unfinished
    wall_s: float
    # CPU seconds of the whole process: on a shared, loaded machine wall time swings with
    # the neighbours, CPU time much less.
    cpu_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_generated_tokens / self.wall_s

    @property
    def tokens_per_cpu_s(self) -> float:
        return self.num_generated_tokens / self.cpu_s


def run_config(engine, workload: Workload, config: str, seed: int) -> Run:
    params = [sampling_params(config, n, seed + i) for i, n in enumerate(workload.output_lens)]
    before = engine.stats()
    start, cpu_start = time.perf_counter(), time.process_time()
    outputs = engine.generate(workload.prompts, params)
    wall_s, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    after = engine.stats()
    return Run(sum(len(o.token_ids) for o in outputs),
               after["num_prompt_tokens_computed"] - before["num_prompt_tokens_computed"],
               after["num_preemptions"] - before["num_preemptions"],
               sum(o.finish_reason == "length" for o in outputs), wall_s, cpu_s)


def make_engine(model_dir: Path, cfg: ApiBenchConfig):
    from workers.engine import LLMEngine

    # Prefix caching off: otherwise every run after the first would find its prompts cached.
    return LLMEngine(str(model_dir), device="cpu", dtype="float32", max_num_seqs=max(64, 4 * cfg.num_requests),
                     max_num_batched_tokens=cfg.max_num_batched_tokens, enable_prefix_caching=False,
                     detokenize=False)


def run_benchmark(cfg: ApiBenchConfig, log: Log = lambda _: None) -> dict:
    from workers.model_files import ensure_model

    started, load_start = time.perf_counter(), os.getloadavg()
    model_dir = ensure_model(cfg.model_cache / f"{cfg.preset}-0", cfg.preset, 0)
    workload = cfg.workload()
    log(f"{cfg.num_requests} requests, {workload.num_output_tokens} output tokens per plain run, "
        f"model {model_dir}, {torch.get_num_threads()} torch threads")
    engine = make_engine(model_dir, cfg)
    for config in CONFIGS:
        run_config(engine, warmup_workload(workload), config, cfg.seed)
    runs = run_repeats(engine, workload, cfg, log)
    result = report(runs)
    result["setup"] = _setup(cfg, workload)
    result["machine"] = {"cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                         "loadavg_start": [round(x, 2) for x in load_start],
                         "loadavg_end": [round(x, 2) for x in os.getloadavg()]}
    result["run_time_s"] = round(time.perf_counter() - started, 1)
    return result


def run_repeats(engine, workload: Workload, cfg: ApiBenchConfig, log: Log) -> dict[str, list[Run]]:
    runs: dict[str, list[Run]] = {config: [] for config in CONFIGS}
    for repeat in range(cfg.repeats):
        # Each round in a rotated order, so no configuration always follows the same one.
        for config in CONFIGS[repeat % len(CONFIGS):] + CONFIGS[:repeat % len(CONFIGS)]:
            run = run_config(engine, workload, config, cfg.seed)
            runs[config].append(run)
            log(f"repeat {repeat} {config:12s} {run.num_generated_tokens:6d} tokens in {run.wall_s:6.2f} s "
                f"= {run.tokens_per_s:7.1f} tokens/s (CPU {run.cpu_s:6.2f} s)")
    return runs


def report(runs: dict[str, list[Run]]) -> dict:
    results = {config: _summary(rs) for config, rs in runs.items()}
    # Each round's own ratio to that round's plain run, then the median over rounds: a
    # slow spell of the machine hits both sides of a ratio alike.
    ratios = {f"{config}_vs_plain": _paired(runs[config], runs["plain"], "tokens_per_s")
              for config in CONFIGS if config != "plain"}
    cpu_time_ratios = {f"{config}_vs_plain": _paired(runs[config], runs["plain"], "tokens_per_cpu_s")
                       for config in CONFIGS if config != "plain"}
    # Ratios must reach their limit; n4's prompt tokens computed must equal the plain run's.
    targets = {k: {"value": ratios[k], "limit": v, "met": ratios[k] >= v} for k, v in TARGETS.items()}
    computed = {config: results[config]["num_prompt_tokens_computed"] for config in ("plain", "n4")}
    targets["n4_prefills_once"] = {"value": computed["n4"], "limit": computed["plain"],
                                   "met": computed["n4"] == computed["plain"]}
    return {"bench": "api", "results": results, "ratios": ratios, "cpu_time_ratios": cpu_time_ratios,
            "targets": targets}


def _paired(runs: list[Run], plain: list[Run], rate: str) -> float:
    return round(statistics.median(getattr(r, rate) / getattr(p, rate) for r, p in zip(runs, plain, strict=True)), 3)


def _summary(runs: list[Run]) -> dict:
    # Seeded: every repeat generates the same tokens and computes the same prompts.
    return {"tokens_per_s": round(statistics.median(r.tokens_per_s for r in runs), 2),
            "wall_s": round(statistics.median(r.wall_s for r in runs), 3),
            "tokens_per_cpu_s": round(statistics.median(r.tokens_per_cpu_s for r in runs), 2),
            "cpu_s": round(statistics.median(r.cpu_s for r in runs), 3),
            "num_generated_tokens": runs[0].num_generated_tokens,
            "num_prompt_tokens_computed": runs[0].num_prompt_tokens_computed,
            "num_preemptions": sum(r.num_preemptions for r in runs),
            "num_cut_at_max_tokens": runs[0].num_cut_at_max_tokens,
            "repeats_tokens_per_s": [round(r.tokens_per_s, 2) for r in runs]}


def _setup(cfg: ApiBenchConfig, workload: Workload) -> dict:
    return {"preset": cfg.preset, "num_requests": cfg.num_requests, "repeats": cfg.repeats, "seed": cfg.seed,
            "prompt_len_range": list(cfg.prompt_len_range), "output_len_range": list(cfg.output_len_range),
            "num_prompt_tokens": sum(len(p) for p in workload.prompts),
            "max_num_batched_tokens": cfg.max_num_batched_tokens, "prefix_caching": False,
            "device": "cpu", "dtype": "float32",
            "configs": {"plain": "temperature 1, seed per request, ignore_eos",
                        "logprobs": "plain + logprobs 5",
                        "penalties": f"plain + frequency 0.5, presence 0.5, repetition 1.1, "
                                     f"logit_bias {dict(LOGIT_BIAS)}",
                        "n4": "plain + n 4 (tokens of all 4 sequences)",
                        "json_schema": f"plain + json_schema, ignore_eos off, max_tokens {JSON_MAX_TOKENS}"},
            "order": "per repeat every configuration in turn; medians over repeats"}

