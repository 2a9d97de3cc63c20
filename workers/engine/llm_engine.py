"""The offline engine: add requests, `step()` them forward, read what each step produced.

One step = schedule (scheduler.py) -> run the model on the paged cache (model_runner.py)
-> sample (sampler.py) -> per-request finish checks (output_processor.py). The same
engine serves prefill workers (requests with a `KVSink`, usually `max_tokens=1`) and
decode workers (KV imported through `reserve_kv` / `write_kv_layer` / `commit_kv`,
kv_import.py). A request of n sequences forks from its one prefill (forking.py).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from transformers import AutoTokenizer

from workers.engine.attention import KVExport
from workers.engine.best_of import BestOf, add_scores
from workers.engine.block_manager import BlockManager
from workers.engine.cost_model import StepCoefficients, StepCostFit
from workers.engine.forking import Forking
from workers.engine.grammar import GrammarCompiler
from workers.engine.kv_cache import DEFAULT_CPU_KV_BYTES, DEFAULT_GPU_MEMORY_FRACTION
from workers.engine.kv_import import KVImport
from workers.engine.kv_types import (
    KVLayout,
    KVSink,
)
from workers.engine.model_runner import ModelRunner, resolve_dtype
from workers.engine.node_activity import NodeActivity
from workers.engine.output_processor import OutputProcessor
from workers.engine.prompt_logprobs import (
    add_prompt_logprobs,
    new_prompt_logprobs,
    prompt_positions,
)
from workers.engine.recent_load import recent_load
from workers.engine.sampler import Sampler, SamplingRow, request_seed
from workers.engine.sampling_params import SamplingParams
from workers.engine.scheduler import DEFAULT_YIELD_TOKENS, ScheduledSeq, Scheduler
from workers.engine.sequence import RequestOutput, Sequence, TokenLogprob
from workers.engine.step_cost import ForwardTimer, StepCostModel, StepPhases, StepRecord
from workers.engine.thread_clock import ThreadClock, ThreadTimes
from workers.engine.warm_memory import keep_freed_memory_warm
from workers.engine.warmup import warmup


class LLMEngine(KVImport, Forking):
    def __init__(self, model_dir: str, block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 1024,
                 enable_prefix_caching: bool = True, device: str | None = None, dtype: str = "float32",
                 *, gpu_memory_fraction: float = DEFAULT_GPU_MEMORY_FRACTION,
                 cpu_kv_bytes: int = DEFAULT_CPU_KV_BYTES, detokenize: bool = True,
                 max_step_records: int = 4096, cuda_graphs: bool | None = None,
                 node_activity: NodeActivity | None = None) -> None:
        """`node_activity`: this engine's slot on its node's board, so each step records how
        busy the node's other engines were during it (`StepRecord.node_busy`)."""
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        keep_freed_memory_warm()  # each step allocates its activations afresh
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError(f"cuda_graphs needs a CUDA device and this engine runs on {self.device}: "
                             "set engine.cuda_graphs to null (on where there is a GPU) or false")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.runner = ModelRunner(str(model_dir), self.device, resolve_dtype(dtype), block_size, num_kv_blocks,
                                  gpu_memory_fraction, cpu_kv_bytes, cuda_graphs=cuda_graphs,
                                  max_num_seqs=max_num_seqs)
        self.block_manager = BlockManager(self.runner.kv_cache.num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens)
        self.sampler = Sampler()
        self.eos_token_ids = self._eos_token_ids()
        self.grammar = GrammarCompiler(self.tokenizer, self.runner.model.config.vocab_size, self.eos_token_ids)
        # Grammar masks are computed on this thread while the forward pass runs (llguidance
        # releases the GIL); one thread, so masks never race each other.
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self.detokenize = detokenize
        self.step_records: deque[StepRecord] = deque(maxlen=max_step_records)
        self.step_phases: deque[StepPhases] = deque(maxlen=max_step_records)  # the latest steps, newest last
        self._forward_timer = ForwardTimer(self.runner.model)
        self.step_cost = StepCostModel()  # sizes `yield_tokens`
        self.cost_fit = StepCostFit()  # the linear step model the router predicts with (`stats`)
        self.node_activity = node_activity
        self._thread_clock = ThreadClock()
        self.num_background_requests = 0  # added with `yield_to_decode` (spilled prompts)
        self.num_prompt_tokens_computed = 0  # prompt positions run through the model (recomputes too)
        # over the steps that ran a batch: their wall time, the engine thread's CPU time in
        # them and its time waiting for a core (`thread_clock.py`), in seconds
        self.step_seconds = {"wall": 0.0, "cpu": 0.0, "run_wait": 0.0}
        self.requests: dict[str, Sequence] = {}  # unfinished, by `Sequence.seq_id`
        self.best_of = BestOf()  # holds the outputs of `best_of > n` requests until they end
        self.reservations: dict[str, Sequence] = {}  # KV imports in flight, by transfer id
        self._pending: list[RequestOutput] = []  # ends decided outside step(), reported by the next one
        # step() and the request/reservation calls may come from different threads (a
        # server loop, a transport); write_kv_layer needs no lock (see its docstring).
        self._lock = threading.RLock()

    @property
    def layout(self) -> KVLayout:
        return self.runner.layout

    def _eos_token_ids(self) -> frozenset[int]:
        ids = self.runner.model.generation_config.eos_token_id
        ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
        if self.tokenizer.eos_token_id is not None:
            ids.append(self.tokenizer.eos_token_id)
        return frozenset(ids)

    # -- requests --------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams, *,
                    kv_sink: KVSink | None = None, seed: int | None = None) -> None:
        """Queue a request. `seed` pins the sampling seed (default: `params.seed`, else random)."""
        with self._lock:
            seq = self._new_sequence(request_id, prompt_token_ids, params, seed)
            seq.kv_sink = kv_sink
            self.scheduler.add(seq)
            self.requests[seq.seq_id] = seq
            self.best_of.track(seq)
            self.num_background_requests += params.yield_to_decode

    def _new_sequence(self, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
                      seed: int | None, index: int = 0) -> Sequence:
        if index == 0 and (request_id in self.requests or self._sequences_of(request_id)):
            raise ValueError(f"request id {request_id!r} is already running")
        prompt = [int(t) for t in prompt_token_ids]
        self._check_fits(prompt, params)
        seq = Sequence(request_id, prompt, params, seed if seed is not None else request_seed(params), index=index,
                       processor=OutputProcessor(self.tokenizer, prompt, params, self.eos_token_ids,
                                                 self.detokenize))
        seq.prompt_logprobs = new_prompt_logprobs(seq)
        seq.matcher = self.grammar.matcher(params.guided) if params.guided else None
        return seq

    def _check_fits(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        num_tokens = len(prompt) + params.max_tokens
        if num_tokens > self.runner.max_model_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) exceeds "
                             f"the model's context length {self.runner.max_model_len}")
        if self.layout.num_blocks(num_tokens) > self.block_manager.num_blocks:
            raise ValueError(f"prompt + max_tokens ({num_tokens} tokens) exceeds the KV pool "
                             f"({self.block_manager.num_blocks} blocks of {self.layout.block_size})")

    def abort_request(self, request_id: str) -> bool:
        """End a request (all its sequences) now, freeing its blocks; the next `step()`
        reports it. False if unknown."""
        with self._lock:
            seqs = self._sequences_of(request_id)
            for seq in seqs:
                self._finish(seq, "abort")
                self._pending.append(self._output(seq, []))
            return bool(seqs)

    def _sequences_of(self, request_id: str) -> list[Sequence]:
        return [seq for seq in self.requests.values() if seq.request_id == request_id]

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        del self.requests[seq.seq_id]
        if seq.kv_sink is not None:  # its KV never went out completely
            seq.kv_sink.on_abort(reason)
            seq.kv_sink = None

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests or self._pending)

    def warmup(self) -> StepCoefficients:
        """Seed the step-cost fit from a few synthetic requests, leaving the engine as it
        was otherwise (workers/engine/warmup.py); call it idle, at start-up."""
        with self._lock:
            return warmup(self)

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Advance every schedulable request by one step; report those that produced or ended.

        Outputs decided between steps (a committed first token, an abort) are reported by
        a step of their own, which runs no batch: they never wait for a forward pass.
        """
        with self._lock:
            if self._pending:
                outputs, self._pending = self._pending, []
                return self.best_of.collect(outputs)
            start_time, t0, thread0 = time.time(), time.perf_counter(), self._thread_clock.read()
            batch = self.scheduler.schedule()
            stamps = [t0, time.perf_counter()]
            outputs, node_busy = self._run_on_node(batch, stamps) if batch else ([], 0.0)
            self._record_step(batch, start_time, stamps, node_busy, self._thread_clock.read() - thread0)
            return self.best_of.collect(outputs)

    def _run_on_node(self, batch: list[ScheduledSeq], stamps: list[float]) -> tuple[list[RequestOutput], float]:
        """`_run`, and how busy the node's other engines were meanwhile (0 without a board)."""
        if self.node_activity is None:
            return self._run(batch, stamps), 0.0
        self.node_activity.begin()
        try:
            outputs = self._run(batch, stamps)
        finally:
            node_busy = self.node_activity.end()
        return outputs, node_busy

    def _run(self, batch: list[ScheduledSeq], stamps: list[float]) -> list[RequestOutput]:
        """Run, sample and account one scheduled batch; stamps the end of each phase
        (the forward, sampling, output) onto `stamps`."""
        sampling = [s for s in batch if s.needs_sample]
        masks = self._start_grammar_masks(sampling)
        logits, prompt_logits = self.runner.run(batch, self._exports(batch))
        stamps.append(time.perf_counter())
        self._add_prompt_logprobs(batch, prompt_logits)
        allowed = masks.result() if masks else [None] * len(sampling)
        sampled = self.sampler.sample(logits, [self._sampling_row(s.seq, a)
                                               for s, a in zip(sampling, allowed, strict=True)])
        stamps.append(time.perf_counter())
        for s in batch:
            s.seq.num_computed_tokens = s.end
            self.block_manager.cache_full_blocks(s.seq)
        forked = self._fork(sampling, logits, sampled, allowed)  # before a parent that ends frees its blocks
        outputs = [self._append_token(s.seq, t, lp)
                   for s, t, lp in zip(sampling, sampled.token_ids, sampled.logprobs, strict=True)]
        add_scores([s.seq for s in sampling], logits)
        stamps.append(time.perf_counter())
        return outputs + forked

    def _add_prompt_logprobs(self, batch: list[ScheduledSeq], prompt_logits: list[torch.Tensor]) -> None:
        for s, rows in zip(batch, prompt_logits, strict=True):
            self.num_prompt_tokens_computed += max(0, min(s.end, s.seq.num_prompt_tokens) - s.start)
            if len(rows):
                add_prompt_logprobs(s.seq, prompt_positions(s.seq, s.start, s.end), rows)

    def _exports(self, batch: list[ScheduledSeq]) -> list[KVExport]:
        """Sinks of requests whose prompt completes this step, with the blocks to send."""
        return [KVExport(s.seq.kv_sink,
                         s.seq.block_ids[s.seq.kv_sink.start_block:self.layout.num_blocks(s.end)])
                for s in batch
                if s.seq.kv_sink is not None and s.needs_sample and not s.seq.output_token_ids]

    def _start_grammar_masks(self, sampling: list[ScheduledSeq]) -> Future[list[torch.Tensor | None]] | None:
        """The next token's grammar masks of the sequences that sample this step, computed
        while the forward pass runs; None when none of them has a grammar."""
        matchers = [s.seq.matcher for s in sampling]
        if not any(matchers):
            return None
        return self._mask_pool.submit(lambda: [m.allowed() if m else None for m in matchers])

    def _sampling_row(self, seq: Sequence, allowed: torch.Tensor | None = None) -> SamplingRow:
        """`allowed`: the grammar mask when `_start_grammar_masks` made it; computed here otherwise."""
        if allowed is None and seq.matcher is not None:
            allowed = seq.matcher.allowed()
        return SamplingRow(seq.params, seq.seed, len(seq.output_token_ids), self.eos_token_ids,
                           seq.prompt_token_ids, seq.output_token_ids, allowed=allowed)

    def _append_token(self, seq: Sequence, token_id: int, logprob: TokenLogprob | None = None) -> RequestOutput:
        """`logprob`: the token's, when the request asked for logprobs (`Sampler.sample`)."""
        if seq.matcher is not None:  # the one place a grammar advances, on both routes
            seq.matcher.accept(token_id)
        seq.output_token_ids.append(token_id)
        if seq.kv_sink is not None and len(seq.output_token_ids) == 1:
            seq.kv_sink.on_complete(token_id, logprob)
            seq.kv_sink = None
        finish_reason, text = seq.processor.append(token_id)
        if finish_reason is not None:
            self._finish(seq, finish_reason)
        return self._output(seq, [token_id], text, [logprob])

    def _output(self, seq: Sequence, new_token_ids: list[int], text: str = "",
                logprobs: Seq[TokenLogprob | None] = ()) -> RequestOutput:
        """`logprobs`: one per new token; reported only when the request asked for them."""
        return RequestOutput(seq.request_id, new_token_ids, list(seq.output_token_ids), seq.is_finished,
                             seq.finish_reason, text, seq.prompt_token_ids, seq.num_cached_tokens,
                             logprobs=list(logprobs) if seq.params.logprobs is not None else None,
                             prompt_logprobs=self._prompt_logprobs(seq, new_token_ids), index=seq.index,
                             queue_s=seq.queue_s if _is_first(seq, new_token_ids) else None)

    @staticmethod
    def _prompt_logprobs(seq: Sequence, new_token_ids: list[int]) -> list[TokenLogprob | None] | None:
        """A sequence's prompt logprobs go with its first token only."""
        return seq.prompt_logprobs if _is_first(seq, new_token_ids) else None

    def _record_step(self, batch: list[ScheduledSeq], start_time: float, stamps: list[float],
                     node_busy: float, thread: ThreadTimes) -> None:
        """`stamps`: perf_counter at the step's start and at the end of each phase that ran;
        `thread`: the engine thread's CPU time and run-queue wait over the step."""
        stamps += [stamps[-1]] * (5 - len(stamps))  # a step without a batch schedules only
        schedule_s, run_s, sample_s, output_s = (b - a for a, b in itertools.pairwise(stamps))
        self.step_phases.append(StepPhases(schedule_s, run_s, self._forward_timer.take(), sample_s, output_s))
        step_time_s = stamps[-1] - stamps[0]
        # The step has advanced each sequence: its chunk was [computed - new, computed).
        chunks = [(s.seq.num_computed_tokens - s.num_new_tokens, s.seq.num_computed_tokens, s.seq)
                  for s in batch]
        decodes = [seq for start, end, seq in chunks if _decodes(start, end, seq)]
        prefills = [(start, end) for start, end, seq in chunks if not _decodes(start, end, seq)]
        record = StepRecord(
            start_time=start_time, step_time_s=step_time_s,
            num_prefill_tokens=sum(end - start for start, end in prefills),
            num_decode_seqs=len(decodes), num_context_tokens=sum(end for _, end, _ in chunks),
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_prefill_seqs=len(prefills),
            prefill_attention_work=sum((end - start) * end for start, end in prefills), node_busy=node_busy,
            cpu_time_s=max(0.0, thread.cpu_s), run_wait_s=max(0.0, thread.wait_s),
            num_finished_streams=sum(1 for seq in decodes if seq.is_finished))
        self.step_records.append(record)
        if batch:
            self.step_seconds["wall"] += step_time_s
            self.step_seconds["cpu"] += record.cpu_time_s
            self.step_seconds["run_wait"] += record.run_wait_s
            self.step_cost.observe(record)
            self.cost_fit.observe(record)
            self.scheduler.yield_tokens = self.step_cost.yield_tokens(DEFAULT_YIELD_TOKENS,
                                                                      self.scheduler.max_num_batched_tokens)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run `prompts` to completion; final outputs in input order (`.token_ids` = generated ids),
        a prompt with `n > 1` giving its `n` in index order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params_list)} sampling params")
        ids = [f"generate-{id(self)}-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, p)
        wanted = {(i, index) for i, p in zip(ids, params_list, strict=True) for index in range(p.n)}
        final: dict[tuple[str, int], RequestOutput] = {}
        while len(final) < len(wanted):
            final.update(((o.request_id, o.index), o) for o in self.step()
                         if o.finished and (o.request_id, o.index) in wanted)
        return [final[i, index] for i, p in zip(ids, params_list, strict=True) for index in range(p.n)]

    # -- introspection -------------------------------------------------------------------------

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, in the cache's dtype."""
        return self.layout.layer_nbytes(1) * self.layout.num_layers // self.layout.block_size

    def stats(self) -> dict[str, Any]:
        """Counters, the queue (`Scheduler.queue_stats`) and the fitted step model, all
        plain ints, floats and dicts (they travel in heartbeats); prefix_cache_queries and
        prefix_cache_hits are both in TOKENS."""
        with self._lock:
            recent = recent_load(self.step_records, time.time())
            return self._counters() | self.scheduler.queue_stats() | (recent.to_stats() if recent else {}) | {
                "step_model": self.cost_fit.coefficients.to_dict(),
                "kv_bytes_per_token": self.kv_bytes_per_token,
                "num_layers": self.layout.num_layers,
                "max_num_batched_tokens": self.scheduler.max_num_batched_tokens,
            }

    def _counters(self) -> dict[str, float]:
        return {f"step_{part}_seconds_total": seconds for part, seconds in self.step_seconds.items()} | {
            "prefix_cache_queries": self.block_manager.num_queried_tokens,
            "prefix_cache_hits": self.block_manager.num_hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "num_background_requests": self.num_background_requests,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "kv_blocks_free": self.block_manager.num_free_blocks,
            "kv_blocks_total": self.block_manager.num_blocks,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }

    def check_integrity(self) -> None:
        """Assert no block is leaked or double-freed and every request is where it should be."""
        with self._lock:
            queued = self.scheduler.running + self.scheduler.waiting
            assert {s.seq_id for s in queued} == set(self.requests), "requests and queues disagree"
            assert len(queued) == len(self.requests), "a request is queued twice"
            tables = [s.block_ids for s in queued] + [r.block_ids for r in self.reservations.values()]
            self.block_manager.check_integrity(tables)


def _is_first(seq: Sequence, new_token_ids: list[int]) -> bool:
    """The output that reports `seq`'s first token."""
    return len(seq.output_token_ids) == len(new_token_ids) == 1


def _decodes(start: int, end: int, seq: Sequence) -> bool:
    """A step's chunk [start, end) of `seq` is one decode token, not prompt tokens."""
    return end - start == 1 and start >= seq.num_prompt_tokens
