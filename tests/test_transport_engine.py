"""The real engines: a prefill engine in one process streams a prompt's KV into a decode
engine in another, which then continues token-identically to a local run."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from tests.test_transport_backends import KEY, config, spawn
from transport.factory import make_receiver
from workers.engine import LLMEngine, SamplingParams

PROMPT = [(7 * i + 3) % 250 for i in range(70)]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=8, temperature=0.8, top_k=20, ignore_eos=True)


def prefill_worker(model_dir: str, jobs, results, device: str = "cpu", dtype: str | None = None) -> None:
    """Child: for each job, prefill with a sink from the named backend's sender."""
    from transport.factory import make_sender

    torch.set_num_threads(1)
    options = {"dtype": dtype} if dtype else {}
    engine = LLMEngine(model_dir, block_size=16, num_kv_blocks=64, device=device, **options)
    senders = {}
    while (job := jobs.get(timeout=120)) is not None:
        backend, tid, address, prompt, params, seed, start_block = job
        sender = senders.setdefault(backend, make_sender(config(backend), KEY))
        sink = sender.open(tid, address, engine.layout, start_block=start_block)
        engine.add_request(tid, prompt, params, kv_sink=sink, seed=seed)
        while engine.has_unfinished_requests():
            engine.step()
        try:
            sink.wait(30)
            results.put((tid, "ok"))
        except Exception as exc:  # noqa: BLE001
            results.put((tid, repr(exc)))
    for sender in senders.values():
        sender.close()


def run_local(engine: LLMEngine, prompt, params, seed) -> list[int]:
    engine.add_request("local", prompt, params, seed=seed)
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    return out[-1].token_ids


def run_remote(engine, receiver, jobs, results, backend, tid, prompt, params, seed) -> list[int]:
    res = engine.reserve_kv(tid, prompt)
    receiver.expect(tid, res, timeout=60)
    jobs.put((backend, tid, receiver.address, prompt, params, seed, res.num_cached_blocks))
    first_token = receiver.wait(tid).token_id
    assert results.get(timeout=60) == (tid, "ok")
    engine.commit_kv(res, tid, params, first_token, seed=seed)
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    return out[-1].token_ids


@pytest.mark.parametrize("backend", ["zmq", "zmq-inline", "shm", "nccl"])
def test_streamed_kv_decodes_token_identically(tiny_model_dir, backend, request):
    ctx = mp.get_context("spawn")
    jobs, results = ctx.Queue(), ctx.Queue()
    proc = spawn(prefill_worker, str(tiny_model_dir), jobs, results)
    decode = LLMEngine(str(tiny_model_dir), block_size=16, num_kv_blocks=64, device="cpu")
    receiver = make_receiver(config(backend), decode, KEY)
    try:
        for params, seed in ((GREEDY, 0), (SAMPLED, 123)):
            expected = run_local(decode, PROMPT, params, seed)
            # The local run left PROMPT's blocks in the prefix cache: this transfer sends only
            # the last block; a fresh prompt exercises the full send.
            for prompt in (PROMPT, [t + 1 for t in PROMPT]):
                want = expected if prompt is PROMPT else run_local(decode, prompt, params, seed)
                tid = f"{backend}-{seed}-{prompt[0]}"
                got = run_remote(decode, receiver, jobs, results, backend, tid, prompt, params,
                                 seed)
                assert got == want, (backend, params, prompt[:4])
        decode.check_integrity()
        assert not receiver.pending_ids()
    finally:
        jobs.put(None)
        proc.join(30)
        receiver.close()


def test_failed_transfer_frees_engine_blocks(tiny_model_dir):
    decode = LLMEngine(str(tiny_model_dir), block_size=16, num_kv_blocks=64, device="cpu")
    receiver = make_receiver(config("zmq"), decode, KEY)
    try:
        free = decode.stats()["kv_blocks_free"]
        res = decode.reserve_kv("doomed", PROMPT)
        receiver.expect("doomed", res, timeout=0.5)
        with pytest.raises(Exception, match="deadline|not complete"):
            receiver.wait("doomed")
        assert decode.stats()["kv_blocks_free"] == free
        decode.check_integrity()
    finally:
        receiver.close()


@pytest.mark.parametrize("backend", ["zmq", "local"])
def test_a_completed_transfer_leaves_a_record_on_its_sender(tiny_model_dir, backend):
    """Both engines in this process: the sender's record has the layout's bytes and
    layers, and its exposed tail (after the last layer) is part of its whole time."""
    from transport.factory import make_sender

    prefill = LLMEngine(str(tiny_model_dir), block_size=16, num_kv_blocks=64, device="cpu")
    decode = LLMEngine(str(tiny_model_dir), block_size=16, num_kv_blocks=64, device="cpu")
    receiver = make_receiver(config(backend), decode, KEY)
    sender = make_sender(config(backend), KEY)
    try:
        res = decode.reserve_kv("t1", PROMPT)
        receiver.expect("t1", res, timeout=60)
        sink = sender.open("t1", receiver.address, prefill.layout, start_block=res.num_cached_blocks)
        prefill.add_request("t1", PROMPT, GREEDY, kv_sink=sink)
        while prefill.has_unfinished_requests():
            prefill.step()
        sink.wait(30)
        receiver.wait("t1", 30)
        decode.cancel_kv(res)
        [record] = list(sender.transfer_records)
        layout = prefill.layout
        assert record.transfer_id == "t1"
        assert record.num_layers == layout.num_layers
        assert record.num_bytes == layout.layer_nbytes(layout.num_blocks(len(PROMPT))) * layout.num_layers
        assert record.data_path == ("local" if backend == "local" else sink.data_path) != "none"
        assert 0 < record.tail_seconds <= record.seconds
        assert sink.tail_seconds == record.tail_seconds  # what the prefill replica's reply says
        assert record.start_time > 0
        assert record.peer == receiver.address != ""  # the receiver it went to
    finally:
        sender.close()
        receiver.close()
