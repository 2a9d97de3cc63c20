"""A prompt placed on a decode replica waits for the step in flight before its queue's
steps begin: half of it on average where no foreground prompt is queued there, none
where one is (the queue's first step is that step, already counted in the drain)."""

from __future__ import annotations

import pytest

from router import predict, replica_steps
from router.candidate import RequestShape
from router.queue_drain import drain
from router.replica_load import ReplicaLoad
from workers.engine.cost_model import StepCoefficients

MODEL = StepCoefficients(fixed_s=0.01, prefill_token_s=0.001, prefill_attention_s=0.0, decode_seq_s=0.002,
                         decode_context_s=0.0)
OWN = RequestShape(prompt_len=100, max_tokens=4)


def _decode(**queue: int) -> ReplicaLoad:
    return ReplicaLoad("d", "decode", MODEL, chunk_tokens=512, num_streams=2, stream_context=40,
                       stream_tokens_left=10.0, **queue)


def _ttft(d: ReplicaLoad) -> float:
    return predict.local(OWN, d, cached=0).prediction.ttft_s


def test_behind_a_decode_step_it_waits_half_of_it():
    d = _decode()
    own = drain(d, predict.foreground(d, 0, OWN.prompt_len)).seconds
    assert _ttft(d) == pytest.approx(own + 0.5 * replica_steps.decode_step_s(d))


def test_behind_a_queued_prompt_the_step_in_flight_is_that_prompts_and_counts_once():
    d = _decode(queue_tokens=120, queue_work=120 * 60)
    assert _ttft(d) == pytest.approx(drain(d, predict.foreground(d, 0, OWN.prompt_len)).seconds)
    assert replica_steps.in_flight_wait_s(d) == 0.0


def test_behind_a_background_prefill_alone_it_waits_half_a_step_with_its_chunk():
    d = _decode(queue_tokens=300, queue_work=300 * 150, background_tokens=300, background_work=300 * 150,
                background_chunk_tokens=16)
    assert replica_steps.in_flight_wait_s(d) == pytest.approx(0.5 * replica_steps.current_step_s(d))
    assert replica_steps.current_step_s(d) > replica_steps.decode_step_s(d)
