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

DEFAULT_MODEL_CACHE = Path("~/.cache/pdcluster/models").expanduser()
HF_BATCH_SIZES = (8, 16, 32)
NUM_BYTE_TOKENS = 256  # prompts use byte tokens only, never specials
# Two logits this close are a tie in fp32: batched and unbatched matmuls sum in different
# orders and differ by ~1e-6 relative, which can flip the argmax between them.
NEAR_TIE_LOGIT_GAP = 1e-4
MAX_MISMATCH_EXAMPLES = 10
Log = Callable[[str], None]
NextLogits = Callable[[list[int]], torch.Tensor]  # token ids -> the next token's logits [vocab]


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

def run_engine(model_dir: Path, workload: Workload, cfg: BenchConfig) -> RunResult:
    from workers.engine import LLMEngine, SamplingParams

    engine = LLMEngine(str(model_dir), device="cpu", dtype="float32",
                       max_num_seqs=max(64, len(workload.prompts)),
                       max_num_batched_tokens=cfg.max_num_batched_tokens, detokenize=False)

    def generate(w: Workload) -> list[list[int]]:
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in w.output_lens]
        return [list(out.token_ids) for out in engine.generate(w.prompts, params)]

    generate(warmup_workload(workload))
    return RunResult("pdcluster", *_timed(lambda: generate(workload)), {})


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

def mismatches(reference: list[list[int]], other: list[list[int]]) -> list[dict]:
    """Requests whose tokens differ, with the first position that differs."""
    out = []
    for i, (a, b) in enumerate(zip(reference, other, strict=True)):
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            out.append({"request": i, "first_diff_at": first, "len": [len(a), len(b)]})
    return out


def classify_divergence(logits: torch.Tensor, token_a: int, token_b: int,
                        tol: float = NEAR_TIE_LOGIT_GAP) -> dict:
    """Two runners chose `token_a` and `token_b` from `logits` [vocab]: a `near_tie` when
    both are within `tol` of the top logit (then they are its top two), else `real`.
    `logit_gap`: the top logit minus the lower of the two."""
    top = logits.max().item()
    gap = top - min(logits[token_a].item(), logits[token_b].item())
    return {"kind": "near_tie" if gap <= tol else "real", "logit_gap": gap}


def classify_mismatches(found: dict[str, list[dict]], reference: list[list[int]], others: dict[str, list[list[int]]],
                        prompts: list[list[int]], next_logits: NextLogits) -> dict:
    """Counts of `near_tie` and `real` mismatches over every runner, with the first
    `MAX_MISMATCH_EXAMPLES` of them. A length difference without a differing token is `real`."""
    counts = {"near_tie": 0, "real": 0}
    examples = []
    logits_cache: dict[tuple[int, int], torch.Tensor] = {}
    for runner, entries in found.items():
        for entry in entries:
            i, first = entry["request"], entry["first_diff_at"]
            ours, theirs = reference[i], others[runner][i]
            verdict: dict = {"kind": "real", "logit_gap": None}
            if first < min(len(ours), len(theirs)):
                if (i, first) not in logits_cache:  # runners often part at the same place
                    logits_cache[i, first] = next_logits(prompts[i] + ours[:first])
                verdict = classify_divergence(logits_cache[i, first], ours[first], theirs[first])
                verdict["tokens"] = [ours[first], theirs[first]]
            counts[verdict["kind"]] += 1
            if len(examples) < MAX_MISMATCH_EXAMPLES:
                examples.append({"runner": runner, **entry, **verdict})
    return {**counts, "examples": examples}


def hf_next_logits(model) -> NextLogits:
    @torch.inference_mode()
    def next_logits(token_ids: list[int]) -> torch.Tensor:
        return model(torch.tensor([token_ids])).logits[0, -1].float()

    return next_logits


def run_benchmark(cfg: BenchConfig, log: Log = lambda _: None) -> dict:
    from workers.model_files import ensure_model

    model_dir = ensure_model(cfg.model_cache / f"{cfg.preset}-0", cfg.preset, 0)
    workload = make_workload(cfg)
    log(f"{cfg.num_requests} requests, {workload.num_output_tokens} output tokens, "
        f"model {model_dir}, {torch.get_num_threads()} torch threads")
    log("pdcluster engine ...")
    engine = run_engine(model_dir, workload, cfg)
    log(f"  {engine.wall_s:.1f} s")
    model = load_hf_model(model_dir)
    by_batch_size = {}
    for batch_size in cfg.hf_batch_sizes:
        log(f"transformers generate, batch size {batch_size} ...")
        by_batch_size[batch_size] = run_hf_generate(model, workload, batch_size)
        log(f"  {by_batch_size[batch_size].wall_s:.1f} s")
    log("transformers continuous batching ...")
    hf_cb = run_hf_continuous_batching(model, workload, cfg)
    log(f"  {hf_cb.wall_s:.1f} s")
    return report(cfg, workload, engine, by_batch_size, hf_cb, hf_next_logits(model))


def report(cfg: BenchConfig, workload: Workload, engine: RunResult,
           by_batch_size: dict[int, RunResult], hf_cb: RunResult, next_logits: NextLogits) -> dict:
    n = workload.num_output_tokens
    hf_gen = min(by_batch_size.values(), key=lambda r: r.wall_s)
    hf_gen.extra["by_batch_size"] = {str(bs): r.summary(n)["tokens_per_s"] for bs, r in by_batch_size.items()}
    results = [engine.summary(n), hf_gen.summary(n), hf_cb.summary(n)]
    found = {f"hf_generate_bs{bs}": mismatches(engine.token_ids, r.token_ids) for bs, r in by_batch_size.items()}
    found["hf_continuous_batching"] = mismatches(engine.token_ids, hf_cb.token_ids)
    others = {f"hf_generate_bs{bs}": r.token_ids for bs, r in by_batch_size.items()}
    others["hf_continuous_batching"] = hf_cb.token_ids
    classified = classify_mismatches(found, engine.token_ids, others, workload.prompts, next_logits)
    return {
        "results": results,
        "ratios": {"vs_hf_generate": round(hf_gen.wall_s / engine.wall_s, 3),
                   "vs_hf_continuous_batching": round(hf_cb.wall_s / engine.wall_s, 3)},
        "cpu_time_ratios": {"vs_hf_generate": round(hf_gen.cpu_s / engine.cpu_s, 3),
                            "vs_hf_continuous_batching": round(hf_cb.cpu_s / engine.cpu_s, 3)},
        "identical_tokens": not any(found.values()),
        "identical_or_near_tie": classified["real"] == 0,
        "mismatches": classified,
        "workload": {"preset": cfg.preset, "num_requests": cfg.num_requests, "seed": cfg.seed,
                     "prompt_len_range": list(cfg.prompt_len_range),
                     "output_len_range": list(cfg.output_len_range),
                     "num_prompt_tokens": sum(len(p) for p in workload.prompts),
                     "num_output_tokens": n, "greedy": True, "ignore_eos": True},
        "env": {"torch": torch.__version__, "transformers": _transformers_version(),
                "torch_threads": torch.get_num_threads(), "device": "cpu", "dtype": "float32"},
    }


def _transformers_version() -> str:
    import transformers

    return transformers.__version__
