"""Captured decode steps, on CPU up to the capture call: `torch.cuda.graph` is the one part
that needs a GPU, so these tests inject `eager_capture` (replay reruns the step into the
same output tensor) and check everything around it: buckets, padding, static buffers,
that padding rows never change the cache, the eager fallbacks, and greedy output."""

from __future__ import annotations

import functools

import pytest
import torch

import workers.engine.llm_engine as llm_engine
from tests.engine_support import MAX_TOKENS, PROMPT_LENS, greedy, hf_greedy, random_prompts
from tests.engine_support import make_engine_fixture as make_engine  # noqa: F401
from workers.engine.attention import KVExport
from workers.engine.cuda_graphs import (
    DecodeBuffers,
    DecodeInputs,
    batch_buckets,
    eager_capture,
    smallest_at_least,
    width_buckets,
)
from workers.engine.decode_probe import blocks_needed, decode_batch, randomize_kv
from workers.engine.model_runner import ModelRunner
from workers.engine.scheduler import ScheduledSeq

BLOCK_SIZE = 16
MAX_GRAPH_BATCH = 8


class LayerSink:
    """Records which layers were exported (a step with exports runs eagerly, layer by layer)."""

    def __init__(self) -> None:
        self.layers: list[int] = []

    def new_digest(self) -> None:
        return None

    def export_buffer(self, nbytes: int) -> None:
        return None

    def on_layer(self, layer_idx: int, kv: torch.Tensor, checksum: int | None = None) -> None:
        self.layers.append(layer_idx)


def test_buckets():
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert batch_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert batch_buckets(1) == (1,)
    assert width_buckets(256) == (16, 32, 64, 128, 256)
    assert width_buckets(100) == (16, 32, 64, 100)
    assert width_buckets(8) == (8,)
    assert smallest_at_least(5, (1, 2, 4, 8)) == 8
    assert smallest_at_least(9, (1, 2, 4, 8)) is None


def test_fill_pads_to_the_bucket():
    buffers = DecodeBuffers.allocate(4, 3, 2, torch.device("cpu"))
    buffers.fill(DecodeInputs(token_ids=[5, 6], positions=[2, 4], slots=[13, 21], context_lens=[3, 5],
                              block_tables=[[6, 1], [10, 11, 12]]))
    static = buffers.attention
    assert buffers.input_ids.tolist() == [5, 6, 0, 0]
    assert buffers.positions.tolist() == [2, 4, 0, 0]
    assert static.slot_mapping.tolist() == [13, 21, 13, 13]  # padding writes into row 0's slot...
    assert static.write_rows.tolist() == [0, 1, 0, 0]  # ...row 0's own K/V
    assert static.block_table.tolist() == [[6, 1, 0], [10, 11, 12], [0, 0, 0], [0, 0, 0]]
    assert static.mask[:, 0, 0].int().tolist() == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 0],
                                                   [1, 0, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]


@pytest.fixture(scope="module")
def runners(tiny_model_dir):
    """The same model twice, graphs on (eager capture) and off, with the same random KV."""
    num_blocks = blocks_needed(MAX_GRAPH_BATCH * 2, 300, BLOCK_SIZE)
    make = functools.partial(ModelRunner, str(tiny_model_dir), torch.device("cpu"), torch.float32, BLOCK_SIZE,
                             num_blocks, 0.9, 0)
    graphed, eager = make(cuda_graphs=True, max_num_seqs=MAX_GRAPH_BATCH, graph_capture=eager_capture), make()
    for runner in (graphed, eager):
        randomize_kv(runner)
    return graphed, eager


@pytest.mark.parametrize("batch,context", [(1, 20), (3, 40), (5, 300), (8, 17)])
def test_graph_step_equals_eager_and_writes_only_real_slots(runners, batch, context):
    graphed, eager = runners
    scheduled = decode_batch(batch, context, BLOCK_SIZE)
    before = graphed.kv_cache.layers[0].clone()
    logits, prompt_logits = graphed.run(scheduled, [])
    expected, _ = eager.run(scheduled, [])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert logits.shape[0] == batch and all(p.shape[0] == 0 for p in prompt_logits)
    changed = (graphed.kv_cache.slots_view(0) != before.view_as(graphed.kv_cache.slots_view(0)))
    written = changed.flatten(2).any(-1).any(0).nonzero().flatten().tolist()
    assert written == sorted(graphed._slots(scheduled))  # noqa: SLF001 - padding rows wrote nothing else
    bucket = (smallest_at_least(batch, graphed.graphs.batches),
              smallest_at_least(-(-(context + 1) // BLOCK_SIZE), graphed.graphs.widths))
    assert bucket in graphed.graphs.captured


def test_steps_that_do_not_fit_run_eagerly(runners):
    graphed, _ = runners
    graphs, calls = graphed.graphs, []
    graphed.graphs.run = lambda inputs: calls.append(inputs) or graphs.__class__.run(graphs, inputs)
    try:
        too_many = decode_batch(MAX_GRAPH_BATCH + 1, 20, BLOCK_SIZE)
        assert graphs.bucket(graphed._decode_inputs(too_many)) is None  # noqa: SLF001
        assert graphed.run(too_many, [])[0].shape[0] == MAX_GRAPH_BATCH + 1
        prefill = [ScheduledSeq(s.seq, 1) for s in decode_batch(2, 20, BLOCK_SIZE)]
        prefill[0].seq.num_computed_tokens = 10  # a prompt chunk (needs no sample yet)
        graphed.run(prefill, [])
        exporting = decode_batch(2, 20, BLOCK_SIZE)
        sink = LayerSink()
        graphed.run(exporting, [KVExport(sink, exporting[0].seq.block_ids)])  # exports KV: eager
        assert sink.layers == list(range(graphed.layout.num_layers))
        assert len(calls) == 1 and calls[0].num_seqs == MAX_GRAPH_BATCH + 1  # only the first reached graphs
    finally:
        del graphed.graphs.run


def test_graphs_need_cuda_unless_capture_is_injected(tiny_model_dir):
    with pytest.raises(ValueError, match="CUDA"):
        ModelRunner(str(tiny_model_dir), torch.device("cpu"), torch.float32, BLOCK_SIZE, 8, 0.9, 0, cuda_graphs=True)
    assert ModelRunner(str(tiny_model_dir), torch.device("cpu"), torch.float32, BLOCK_SIZE, 8, 0.9, 0).graphs is None


def test_the_engine_setting_reaches_the_runner_and_is_refused_without_cuda(tiny_model_dir):
    from cluster.config import EngineSettings

    settings = EngineSettings(cuda_graphs=False, num_kv_blocks=32).model_dump()
    settings.pop("warmup")
    engine = llm_engine.LLMEngine(str(tiny_model_dir), **settings, device="cpu")
    assert engine.runner.graphs is None
    with pytest.raises(ValueError, match="engine.cuda_graphs"):
        llm_engine.LLMEngine(str(tiny_model_dir), **{**settings, "cuda_graphs": True}, device="cpu")
    assert EngineSettings().cuda_graphs is None  # on where the device is CUDA


def test_greedy_output_with_graphs_matches_transformers(make_engine, monkeypatch, tiny_model_dir):  # noqa: F811
    from transformers import AutoModelForCausalLM

    def graphed_runner(*args, **kwargs):  # the engine passes its own cuda_graphs / max_num_seqs
        return ModelRunner(*args, **{**kwargs, "cuda_graphs": True, "max_num_seqs": MAX_GRAPH_BATCH,
                                     "graph_capture": eager_capture})

    monkeypatch.setattr(llm_engine, "ModelRunner", graphed_runner)
    prompts = random_prompts(PROMPT_LENS)
    engine = make_engine(max_num_seqs=MAX_GRAPH_BATCH)
    outs = engine.generate(prompts, [greedy(n) for n in MAX_TOKENS])
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    assert [o.token_ids for o in outs] == [hf_greedy(hf_model, p, n) for p, n in zip(prompts, MAX_TOKENS, strict=True)]
    assert engine.runner.graphs.captured  # decode steps went through the graphs


def test_a_failed_capture_leaves_decoding_eager(tiny_model_dir):
    def failing_capture(step):
        step()  # the warm-up ran, then capture failed
        raise RuntimeError("operation not permitted when stream is capturing")

    runner = ModelRunner(str(tiny_model_dir), torch.device("cpu"), torch.float32, BLOCK_SIZE, 64, 0.9, 0,
                         cuda_graphs=True, max_num_seqs=4, graph_capture=failing_capture)
    scheduled = decode_batch(2, 20, BLOCK_SIZE)
    for _ in range(2):
        assert runner.run(scheduled, [])[0].shape[0] == 2
    assert runner.graphs.failed and not runner.graphs.captured
