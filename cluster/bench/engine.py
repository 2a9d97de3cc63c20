"""`pdcluster bench engine`: this engine against transformers' two ways to batch.

One process, one model, one workload (random prompts with `ignore_eos`, greedy), three
runners: `LLMEngine.generate`; `model.generate` on left-padded static batches (best of
several batch sizes); and transformers' own continuous batching (the manager that
`model.generate_batch` drives, fed per-request `max_new_tokens`, which `generate_batch`
cannot take). Each runner is warmed up untimed, then timed on the whole workload; only
generated tokens count. All must produce the same tokens; mismatches are reported, each
classified at its first differing token from transformers' fp32 logits there: a
`near_tie` when both runners' tokens are within `NEAR_TIE_LOGIT_GAP` of the top logit
(float rounding picks either), else `real`.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from cluster.bench.engine_efficiency import measure_efficiency
from cluster.bench.engine_mismatches import (
    NextLogits,
    classify_by_logprobs,
    classify_mismatches,
    hf_next_logits,
    mismatches,
)
from cluster.bench.engine_profile import run_profile
from workers.engine.sequence import TokenLogprob

DEFAULT_MODEL_CACHE = Path("~/.cache/pdcluster/models").expanduser()
HF_BATCH_SIZES = (8, 16, 32)
NUM_BYTE_TOKENS = 256  # prompts use byte tokens only, never specials
NUM_TOP_LOGPROBS = 2  # the engine's top two, to tell a near tie at a mismatch
Log = Callable[[str], None]


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass(frozen=True)
class BenchConfig:
    preset: str = "small"
    num_requests: int = 48
    seed: int = 0
    prompt_len_range: tuple[int, int] = (32, 512)
    output_len_range: tuple[int, int] = (16, 128)
    hf_batch_sizes: tuple[int, ...] = HF_BATCH_SIZES
    max_num_batched_tokens: int = 1024  # the engine's token budget; HF CB gets the same
    decode_batches: tuple[int, ...] = (1, 8, 32)  # decode shapes measured against the read floor
    decode_contexts: tuple[int, ...] = (512, 2048)
    model_cache: Path = DEFAULT_MODEL_CACHE


@dataclass
class RunResult:
    name: str
    token_ids: list[list[int]]
    wall_s: float
    # CPU seconds of the whole process (all threads): on a shared, loaded machine wall time
    # swings with the neighbours, CPU time much less.
    cpu_s: float
    extra: dict
    logprobs: list[list[TokenLogprob]] | None = None  # per request and token, when asked for

    def summary(self, num_output_tokens: int) -> dict:
        return {"name": self.name, "tokens_per_s": round(num_output_tokens / self.wall_s, 2),
                "wall_s": round(self.wall_s, 3), "cpu_s": round(self.cpu_s, 3), **self.extra}


def make_workload(cfg: BenchConfig) -> Workload:
    rng = random.Random(cfg.seed)
    prompt_lens = [rng.randint(*cfg.prompt_len_range) for _ in range(cfg.num_requests)]
    output_lens = [rng.randint(*cfg.output_len_range) for _ in range(cfg.num_requests)]
    prompts = [[rng.randrange(NUM_BYTE_TOKENS) for _ in range(n)] for n in prompt_lens]
    return Workload(prompts, output_lens)


def warmup_workload(workload: Workload) -> Workload:
    """A few short requests so first-call costs (allocation, kernel choice) stay untimed."""
    return Workload([p[:32] for p in workload.prompts[:4]], [4] * min(4, len(workload.prompts)))


def _timed(fn: Callable[[], list[list[int]]]) -> tuple[list[list[int]], float, float]:
    """The tokens, wall seconds and process CPU seconds of one call."""
    start, cpu_start = time.perf_counter(), time.process_time()
    token_ids = fn()
    return token_ids, time.perf_counter() - start, time.process_time() - cpu_start


# -- runners ---------------------------------------------------------------------------------

def run_engine(model_dir: Path, workload: Workload, cfg: BenchConfig, num_logprobs: int | None = None) -> RunResult:
    """The timed engine run; with `num_logprobs`, each token's logprob and top alternatives
    too (the same steps, so the same tokens: logprobs are read off the raw logits)."""
    from workers.engine import LLMEngine, SamplingParams

    engine = LLMEngine(str(model_dir), device="cpu", dtype="float32",
                       max_num_seqs=max(64, len(workload.prompts)),
                       max_num_batched_tokens=cfg.max_num_batched_tokens, detokenize=False)
    outputs = []

    def generate(w: Workload) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=num_logprobs)
                  for n in w.output_lens]
        outputs[:] = engine.generate(w.prompts, params)
        return [list(out.token_ids) for out in outputs]

    generate(warmup_workload(workload))
    result = RunResult("pdcluster", *_timed(lambda: generate(workload)), {})
    if num_logprobs is not None:
        result.logprobs = [list(out.logprobs or ()) for out in outputs]
    return result


def load_hf_model(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run_hf_generate(model, workload: Workload, batch_size: int) -> RunResult:
    def generate(w: Workload) -> list[list[int]]:
        out: list[list[int]] = []
        for start in range(0, len(w.prompts), batch_size):
            out += _hf_generate_batch(model, w.prompts[start:start + batch_size],
                                      w.output_lens[start:start + batch_size])
        return out

    generate(warmup_workload(workload))
    return RunResult("hf_generate", *_timed(lambda: generate(workload)), {"batch_size": batch_size})


@torch.inference_mode()
def _hf_generate_batch(model, prompts: list[list[int]], output_lens: list[int]) -> list[list[int]]:
    """One left-padded static batch run to its longest request, then cut to each's length."""
    pad_id = model.generation_config.pad_token_id
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    # eos_token_id=None: ignore_eos, so EOS neither stops a row nor is masked.
    sequences = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                               max_new_tokens=max(output_lens), eos_token_id=None, pad_token_id=pad_id)
    return [sequences[i, width:width + n].tolist() for i, n in enumerate(output_lens)]


def run_hf_continuous_batching(model, workload: Workload, cfg: BenchConfig) -> RunResult:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens),
                               eos_token_id=None, pad_token_id=model.generation_config.pad_token_id)
    # Sized explicitly: on CPU its memory probe needs psutil, and the whole workload fits.
    page_size = 256
    num_tokens = sum(len(p) + n for p, n in zip(workload.prompts, workload.output_lens, strict=True))
    cb_cfg = ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=cfg.max_num_batched_tokens,
                                      num_blocks=num_tokens // page_size + 2 * len(workload.prompts))
    with model.continuous_batching_context_manager(generation_config=gen_cfg, block=True, timeout=5,
                                                   continuous_batching_config=cb_cfg) as manager:
        _cb_generate(manager, warmup_workload(workload))
        timed = _timed(lambda: _cb_generate(manager, workload))
    return RunResult("hf_continuous_batching", *timed, {})


def _cb_generate(manager, w: Workload) -> list[list[int]]:
    stamp = time.monotonic_ns()
    request_ids = [manager.add_request(p, request_id=f"bench-{stamp}-{i}", max_new_tokens=n, eos_token_id=-1)
                   for i, (p, n) in enumerate(zip(w.prompts, w.output_lens, strict=True))]
    finished: dict[str, list[int]] = {}
    while len(finished) < len(request_ids):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            if result.error:
                raise RuntimeError(f"transformers continuous batching failed: {result.error}")
            finished[result.request_id] = list(result.generated_tokens)
        elif result is None and not manager.is_running():
            raise RuntimeError("transformers continuous batching stopped before finishing")
    return [finished[r] for r in request_ids]


# -- the benchmark -----------------------------------------------------------------------------

def run_benchmark(cfg: BenchConfig, log: Log = lambda _: None) -> dict:
    from workers.model_files import ensure_model

    model_dir = ensure_model(cfg.model_cache / f"{cfg.preset}-0", cfg.preset, 0)
    workload = make_workload(cfg)
    log(f"{cfg.num_requests} requests, {workload.num_output_tokens} output tokens, "
        f"model {model_dir}, {torch.get_num_threads()} torch threads")
    log("pdcluster engine ...")
    engine = run_engine(model_dir, workload, cfg)
    log(f"  {engine.wall_s:.1f} s")
    efficiency = measure_efficiency(model_dir, cfg.max_num_batched_tokens, cfg.decode_batches,
                                    cfg.decode_contexts, log)
    model = load_hf_model(model_dir)
    by_batch_size = {}
    for batch_size in cfg.hf_batch_sizes:
        log(f"transformers generate, batch size {batch_size} ...")
        by_batch_size[batch_size] = run_hf_generate(model, workload, batch_size)
        log(f"  {by_batch_size[batch_size].wall_s:.1f} s")
    log("transformers continuous batching ...")
    hf_cb = run_hf_continuous_batching(model, workload, cfg)
    log(f"  {hf_cb.wall_s:.1f} s")
    engine_logprobs = None
    if any(r.token_ids != engine.token_ids for r in [*by_batch_size.values(), hf_cb]):
        log("pdcluster engine again, with logprobs, to classify the mismatches ...")
        engine_logprobs = same_run_logprobs(engine, run_engine(model_dir, workload, cfg, NUM_TOP_LOGPROBS))
    return report(cfg, workload, engine, by_batch_size, hf_cb, hf_next_logits(model), efficiency, engine_logprobs)


def run_profile_report(cfg: BenchConfig, context: int, log: Log = lambda _: None) -> dict:
    """`bench engine --profile`: the step phases at `cfg.decode_batches` and `context`, and a prefill step."""
    from workers.model_files import ensure_model

    model_dir = ensure_model(cfg.model_cache / f"{cfg.preset}-0", cfg.preset, 0)
    profile = run_profile(model_dir, cfg.max_num_batched_tokens, cfg.decode_batches, context, log)
    return {"profile": profile, "workload": {"preset": cfg.preset, "decode_context": context,
                                             "chunk_tokens": cfg.max_num_batched_tokens, "detokenize": True},
            "env": env()}


def same_run_logprobs(timed: RunResult, rerun: RunResult) -> list[list[TokenLogprob]] | None:
    """The rerun's logprobs when it produced the timed run's tokens (it computes the same
    steps); None otherwise, as then they would describe other text."""
    return rerun.logprobs if rerun.token_ids == timed.token_ids else None


def report(cfg: BenchConfig, workload: Workload, engine: RunResult, by_batch_size: dict[int, RunResult],
           hf_cb: RunResult, next_logits: NextLogits, efficiency: dict,
           engine_logprobs: list[list[TokenLogprob]] | None = None) -> dict:
    """`efficiency`: `measure_efficiency`'s limits and ratios. `engine_logprobs`: the
    engine's top logprobs per request and token, to classify mismatches by (when any)."""
    n = workload.num_output_tokens
    hf_gen = min(by_batch_size.values(), key=lambda r: r.wall_s)
    hf_gen.extra["by_batch_size"] = {str(bs): r.summary(n)["tokens_per_s"] for bs, r in by_batch_size.items()}
    results = [engine.summary(n), hf_gen.summary(n), hf_cb.summary(n)]
    others = {f"hf_generate_bs{bs}": r.token_ids for bs, r in by_batch_size.items()}
    others["hf_continuous_batching"] = hf_cb.token_ids
    found = {runner: mismatches(engine.token_ids, token_ids) for runner, token_ids in others.items()}
    classified = classify_mismatches(found, engine.token_ids, others, workload.prompts, next_logits)
    classified["by_engine_logprobs"] = (None if engine_logprobs is None else
                                        classify_by_logprobs(found, engine.token_ids, others, engine_logprobs))
    return {
        "results": results,
        "ratios": {"vs_hf_generate": round(hf_gen.wall_s / engine.wall_s, 3),
                   "vs_hf_continuous_batching": round(hf_cb.wall_s / engine.wall_s, 3),
                   **efficiency["ratios"]},
        "cpu_time_ratios": {"vs_hf_generate": round(hf_gen.cpu_s / engine.cpu_s, 3),
                            "vs_hf_continuous_batching": round(hf_cb.cpu_s / engine.cpu_s, 3)},
        "limits": efficiency["limits"],
        "identical_tokens": not any(found.values()),
        "identical_or_near_tie": classified["real"] == 0,
        "mismatches": classified,
        "workload": {"preset": cfg.preset, "num_requests": cfg.num_requests, "seed": cfg.seed,
                     "prompt_len_range": list(cfg.prompt_len_range),
                     "output_len_range": list(cfg.output_len_range),
                     "num_prompt_tokens": sum(len(p) for p in workload.prompts),
                     "num_output_tokens": n, "greedy": True, "ignore_eos": True},
        "env": env(),
    }


def env() -> dict:
    return {"torch": torch.__version__, "transformers": _transformers_version(),
            "torch_threads": torch.get_num_threads(), "device": "cpu", "dtype": "float32"}


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
