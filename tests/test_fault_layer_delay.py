"""The test-only `faults.kv_layer_delay_s`: each KV layer waits on the sender's channel
thread before it goes out, as on a slow link. Real engines and the real zmq transport
in this process, no Ray: a transfer of N layers takes at least N x the delay, the
prefill engine's steps are not held up, the tail grows, and the KV and the greedy
continuation are exactly the undelayed ones. Off by config, it is never reached."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.test_transport_backends import KEY, config
from transport.base import TransferCorrupt
from transport.factory import make_receiver, make_sender
from transport.transfer_record import TransferRecord
from workers.engine import LLMEngine, SamplingParams
from workers.faults import FaultSettings, FaultState, wrap_sender

PROMPT = [(11 * i + 2) % 250 for i in range(70)]  # 5 blocks of 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DELAY_S = 0.2


@dataclass
class Transferred:
    token_ids: list[int]  # the decode engine's greedy continuation
    kv: list[torch.Tensor]  # each layer as the decode engine's blocks hold it
    record: TransferRecord


def engine(model_dir) -> LLMEngine:
    return LLMEngine(str(model_dir), block_size=16, num_kv_blocks=64, device="cpu")


def warm_engine(model_dir) -> LLMEngine:
    """An engine past its first-step costs, so a step's time is a step's."""
    warm = engine(model_dir)
    warm.generate([PROMPT[:20]], SamplingParams(max_tokens=1, temperature=0.0))
    return warm


def transfer(model_dir, backend: str, faults: FaultState | None = None, tid: str = "t") -> Transferred:
    """One prompt from a fresh prefill engine into a fresh decode engine, then decoded."""
    prefill, decode = warm_engine(model_dir), engine(model_dir)
    receiver = make_receiver(config(backend), decode, KEY)
    sender = make_sender(config(backend), KEY)
    if faults is not None:
        sender = wrap_sender(sender, faults)
    try:
        res = decode.reserve_kv(tid, PROMPT)
        receiver.expect(tid, res, timeout=60)
        sink = sender.open(tid, receiver.address, prefill.layout, start_block=res.num_cached_blocks)
        prefill.add_request(tid, PROMPT, SamplingParams(max_tokens=1, temperature=0.0), kv_sink=sink)
        while prefill.has_unfinished_requests():
            prefill.step()
        sink.wait(30)
        first = receiver.wait(tid, 30)
        cache = decode.runner.kv_cache
        kv = [cache.read_blocks(i, res.block_ids).clone() for i in range(decode.layout.num_layers)]
        decode.commit_kv(res, tid, GREEDY, first.token_id)
        token_ids: list[int] = []
        while decode.has_unfinished_requests():
            token_ids = next((o.token_ids for o in decode.step() if o.finished), token_ids)
        [record] = list(sender.transfer_records)
        return Transferred(token_ids, kv, record)
    finally:
        sender.close()
        receiver.close()


def delaying(delay_s: float) -> FaultState:
    return FaultState(FaultSettings(enabled=True, kv_layer_delay_s=delay_s))


@pytest.fixture(scope="module")
def undelayed(tiny_model_dir) -> Transferred:
    return transfer(tiny_model_dir, "zmq")


@pytest.mark.parametrize("backend", ["zmq", "zmq-inline"])
def test_each_layer_waits_and_arrives_unchanged(tiny_model_dir, undelayed, backend):
    faults = delaying(DELAY_S)
    got = transfer(tiny_model_dir, backend, faults)
    num_layers = got.record.num_layers
    assert num_layers >= 2 and faults.describe()["num_delayed_layers"] == num_layers
    record = got.record
    assert record.seconds >= num_layers * DELAY_S
    # the engine handed every layer without waiting on one (it only queues them), so the
    # wait lands after the prompt is done, in the exposed tail
    handing_s = record.seconds - record.tail_seconds
    assert handing_s < DELAY_S
    assert record.tail_seconds >= num_layers * DELAY_S - handing_s
    assert got.token_ids == undelayed.token_ids == engine(tiny_model_dir).generate([PROMPT], GREEDY)[0].token_ids
    assert all(torch.equal(a, b) for a, b in zip(got.kv, undelayed.kv, strict=True))


def test_set_faults_switches_the_delay_on_and_off_at_run_time(tiny_model_dir, undelayed):
    faults = delaying(0.0)
    faults.set({"kv_layer_delay_s": DELAY_S})
    assert faults.describe() | {"num_injected": 0} == {
        "enabled": True, "kv_transfer": "none", "probability": 1.0, "kv_layer_delay_s": DELAY_S,
        "num_injected": 0, "num_delayed_layers": 0}
    assert transfer(tiny_model_dir, "zmq", faults, "on").record.seconds >= 2 * DELAY_S
    faults.set({"kv_layer_delay_s": 0})
    num_delayed = faults.num_delayed_layers
    got = transfer(tiny_model_dir, "zmq", faults, "off")
    assert faults.num_delayed_layers == num_delayed and got.token_ids == undelayed.token_ids
    faults.set({"kv_layer_delay_s": DELAY_S, "kv_transfer": "stall"})  # one spec, both faults
    faults.set({"kv_transfer": "none"})  # a spec replaces the whole fault: the delay ends too
    assert faults.kv_layer_delay_s == 0.0
    with pytest.raises(ValueError):
        faults.set({"kv_layer_delay_s": -1.0})


def test_inert_unless_enabled(tiny_model_dir):
    faults = FaultState(FaultSettings(kv_layer_delay_s=5.0))  # a delay without `enabled`
    sender = make_sender(config("zmq"), KEY)
    try:
        assert wrap_sender(sender, faults) is sender
    finally:
        sender.close()
    assert faults.describe()["kv_layer_delay_s"] == 0.0
    with pytest.raises(PermissionError):
        faults.set({"kv_layer_delay_s": 5.0})
    assert transfer(tiny_model_dir, "zmq", faults).record.seconds < 5.0


def test_the_corrupt_fault_still_corrupts_through_the_same_wrapper(tiny_model_dir):
    faults = FaultState(FaultSettings(enabled=True, kv_transfer="corrupt"))
    with pytest.raises(TransferCorrupt):
        transfer(tiny_model_dir, "zmq-inline", faults)
    assert faults.describe()["num_injected"] == 1
