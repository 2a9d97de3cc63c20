"""gpu_check's decode-graph harness on CPU: the same code the GPU run executes, with
`eager_capture` standing in for `torch.cuda.graph` (which needs a GPU)."""

from __future__ import annotations

import torch

from cluster.bench.gpu_check import GRAPH_LOGIT_TOLERANCE, check_decode_graphs
from workers.engine.cuda_graphs import eager_capture


def test_decode_graph_harness_times_both_ways_and_agrees(tiny_model_dir):
    rows = check_decode_graphs(str(tiny_model_dir), "cpu", torch.float32, ((1, 40), (3, 100)), num_steps=1,
                               graph_capture=eager_capture)
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 40), (3, 100)]
    for row in rows:
        assert row["eager_ms"] > 0 and row["graph_ms"] > 0 and row["speedup"] > 0
        assert row["max_logit_diff"] < GRAPH_LOGIT_TOLERANCE
