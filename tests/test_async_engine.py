"""AsyncEngine on the real tiny model: streams equal the offline engine, aborts free
blocks, deadlines end requests, KV imported through it continues exactly like a local
run, and a dead engine loop fails every stream instead of hanging it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from workers.async_engine import AsyncEngine, DeadlineExceeded, EngineDeadError
from workers.engine.llm_engine import LLMEngine
from workers.engine.sampling_params import SamplingParams
from workers.protocol import GenerateChunk

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
PROMPTS = [list(range(10, 50)), list(range(100, 137)), [5, 6, 7]]


@pytest.fixture(scope="module")
def offline(tiny_model_dir):
    return LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=256)


@pytest.fixture
def aengine(tiny_model_dir):
    ae = AsyncEngine(LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=256))
    yield ae
    ae.shutdown()


async def collect(stream) -> tuple[list[int], str, GenerateChunk]:
    token_ids: list[int] = []
    text = ""
    last = None
    async for chunk in stream:
        token_ids += chunk.token_ids
        text += chunk.text
        last = chunk
    return token_ids, text, last


async def wait_until(predicate, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if await predicate():
            return
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached in time")


def test_concurrent_streams_equal_offline(aengine, offline):
    expected = [o.token_ids for o in offline.generate(PROMPTS, GREEDY)]

    async def main():
        streams = [aengine.generate(f"r{i}#0", p, GREEDY, seed=i) for i, p in enumerate(PROMPTS)]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(main())
    for (token_ids, _text, last), want in zip(results, expected, strict=True):
        assert token_ids == want
        assert last.finished and last.finish_reason in ("stop", "length")
        assert last.num_prompt_tokens > 0
    assert aengine.num_streams == 0


def test_leaving_a_stream_aborts_and_frees_blocks(aengine):
    async def main():
        total = (await aengine.stats())["kv_blocks_total"]
        params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
        stream = aengine.generate("long#0", PROMPTS[0], params, seed=0)
        async for _ in stream:
            break
        await stream.aclose()

        async def all_free():
            s = await aengine.stats()
            return s["kv_blocks_free"] == total and s["num_running"] == 0

        await wait_until(all_free, timeout_s=1.0)
        await aengine.check_integrity()

    asyncio.run(main())


def test_deadline_raises_and_frees(aengine):
    import time

    async def main():
        params = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        with pytest.raises(DeadlineExceeded):
            await collect(aengine.generate("late#0", PROMPTS[1], params, seed=0, deadline=time.time() + 0.3))
        await wait_until(lambda: _no_requests(aengine))
        await aengine.check_integrity()

    asyncio.run(main())


async def _no_requests(aengine) -> bool:
    s = await aengine.stats()
    return s["num_running"] == 0 and s["num_waiting"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


class _DirectSink:
    """An in-process KVSink writing each layer straight into the decode side's AsyncEngine
    from another thread, as a transport receiver would."""

    def __init__(self, target: AsyncEngine, reservation) -> None:
        self.target, self.reservation = target, reservation
        self.start_block = reservation.num_cached_blocks
        self.first_token_id: int | None = None
        self.done = threading.Event()

    def new_digest(self):
        return None

    def export_buffer(self, nbytes):
        return None

    def on_layer(self, layer_idx, kv, checksum=None):
        t = threading.Thread(target=self.target.write_kv_layer, args=(self.reservation, layer_idx, kv))
        t.start()
        t.join()

    def on_complete(self, first_token_id, logprob=None):
        self.first_token_id = first_token_id
        self.done.set()

    def on_abort(self, reason):
        self.done.set()


def test_imported_kv_continues_like_local(tiny_model_dir, offline):
    """Tokens and text of the stream from imported KV are the local stream's; its first
    chunk is the prefill replica's token with that token's text. Engine queue times come
    from the engine that ran each prompt, never from the one that imported its KV."""
    prompt = PROMPTS[0]
    want = offline.generate([prompt], GREEDY)[0].token_ids
    prefill_waits: list[float] = []
    decode_waits: list[float] = []
    prefill = AsyncEngine(LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=64),
                          on_queue_time=prefill_waits.append)
    decode = AsyncEngine(LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=64),
                         on_queue_time=decode_waits.append)

    async def main():
        _, want_text, _ = await collect(prefill.generate("l#0", prompt, GREEDY, seed=0))
        res = await decode.reserve_kv("t1", prompt)
        assert res is not None and decode.num_open_reservations == 1
        sink = _DirectSink(decode, res)
        first_params = SamplingParams(max_tokens=1, temperature=0.0)
        token_ids, first_text, _ = await collect(prefill.generate("p#0", prompt, first_params, seed=0, kv_sink=sink))
        assert sink.done.is_set() and token_ids == [sink.first_token_id]
        stream = decode.generate_from_kv(res, "d#0", GREEDY, sink.first_token_id, 0)
        first = await anext(stream)
        assert first.token_ids[0] == sink.first_token_id and first.text.startswith(first_text)
        got, text, last = await collect(stream)
        assert first.token_ids + got == want and first.text + text == want_text and last.finished
        assert decode.num_open_reservations == 0
        await wait_until(lambda: _no_requests(decode))
        await decode.check_integrity()
        assert len(prefill_waits) == 2 and min(prefill_waits) >= 0  # the local run and the prefill
        assert decode_waits == []

    try:
        asyncio.run(main())
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_cancelled_reservation_drops_late_layers(aengine):
    async def main():
        res = await aengine.reserve_kv("t-cancel", PROMPTS[0])
        aengine.cancel_kv(res)
        aengine.cancel_kv(res)  # idempotent
        import torch

        kv = torch.zeros(res.layout.layer_shape(res.num_blocks_to_receive))
        await asyncio.to_thread(aengine.write_kv_layer, res, 0, kv)  # dropped, no error
        assert aengine.num_open_reservations == 0
        await wait_until(lambda: _no_requests(aengine))
        await aengine.check_integrity()

    asyncio.run(main())


def test_dead_engine_fails_streams_and_health(tiny_model_dir):
    engine = LLMEngine(str(tiny_model_dir), device="cpu", num_kv_blocks=64)
    ae = AsyncEngine(engine)

    def broken_step():
        raise RuntimeError("injected step failure")

    engine.step = broken_step

    async def main():
        with pytest.raises(EngineDeadError):
            await collect(ae.generate("x#0", PROMPTS[0], GREEDY, seed=0))
        with pytest.raises(EngineDeadError):
            ae.check_health()
        with pytest.raises(EngineDeadError):
            await ae.stats()

    asyncio.run(main())


def test_layer_write_does_not_wait_for_the_engine_thread(aengine):
    """A receiver's layer write lands while the engine thread is busy (a long step): it
    must not queue behind the step, or a busy decode replica takes a step per layer."""
    import torch

    async def main():
        res = await aengine.reserve_kv("t-busy", PROMPTS[0])
        release = threading.Event()
        busy = aengine.submit(release.wait, 10)  # the engine thread is occupied
        kv = torch.ones(res.layout.layer_shape(res.num_blocks_to_receive))
        try:
            await asyncio.wait_for(asyncio.to_thread(aengine.write_kv_layer, res, 0, kv), 5)
            assert 0 in res.layers_written and not busy.done()
        finally:
            release.set()
        aengine.cancel_kv(res)
        assert aengine.num_open_reservations == 0
        await wait_until(lambda: _no_requests(aengine))
        await aengine.check_integrity()

    asyncio.run(main())
