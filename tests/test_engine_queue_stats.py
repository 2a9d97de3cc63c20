"""What a replica tells the router about its queue: the prefill work of a prompt range
in the engine's chunking, the queue and step model in `stats()`, and a background
prefill's per-request chunk size (`SamplingParams.prefill_chunk_tokens`)."""

from __future__ import annotations

import itertools

import pytest

from workers.engine.cost_model import prefill_work


def brute_prefill_work(start: int, end: int, chunk: int) -> tuple[int, int, int]:
    chunks = [(pos, min(pos + chunk, end)) for pos in range(start, end, chunk)]
    return len(chunks), sum(e - s for s, e in chunks), sum((e - s) * e for s, e in chunks)


def test_prefill_work_matches_a_chunk_by_chunk_count():
    for start, length, chunk in itertools.product([0, 1, 15, 16, 100], [0, 1, 2, 15, 16, 17, 64, 333],
                                                  [1, 2, 16, 17, 64, 1024]):
        assert prefill_work(start, start + length, chunk) == brute_prefill_work(start, start + length, chunk)


def test_prefill_work_of_nothing_and_a_bad_chunk():
    assert prefill_work(10, 10, 8) == prefill_work(10, 3, 8) == (0, 0, 0)
    with pytest.raises(ValueError, match="chunk"):
        prefill_work(0, 10, 0)
