"""The router <-> worker stream over real ZeroMQ sockets on 127.0.0.1: chunks in order,
cancellation reaching the worker's generator, a killed worker process or a vanished
router noticed in seconds, and every message a peer without the key (or a replayer)
sends refused. (The wire format itself: test_stream_wire.py.)"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest
import zmq
import zmq.asyncio

from tests.test_stream_wire import KEY, _request
from workers.engine.sampling_params import SamplingParams
from workers.protocol import GenerateChunk, GenerateRequest
from workers.stream.client import ReplicaGone, WorkerCallFailed, WorkerStreams
from workers.stream.server import StreamServer
from workers.stream.wire import OPEN, StreamCodec, to_wire


class Worker:
    """A handler like a worker's `generate`: `max_tokens` chunks, then finished; records
    whether each generator was closed (the engine request aborted) and why."""

    def __init__(self, delay_s: float = 0.0, fail: bool = False) -> None:
        self.delay_s, self.fail = delay_s, fail
        self.closed: list[str] = []
        self.started = asyncio.Event()

    async def generate(self, req: GenerateRequest):
        self.started.set()
        try:
            for i in range(req.params.max_tokens):
                if self.fail and i == 1:
                    raise RuntimeError("engine exploded")
                await asyncio.sleep(self.delay_s)
                last = i == req.params.max_tokens - 1
                yield GenerateChunk(token_ids=[100 + i], text=chr(97 + i % 26), finished=last,
                                    finish_reason="length" if last else None,
                                    route="local" if i == 0 else None)
            self.closed.append("finished")
        except BaseException as exc:
            self.closed.append(type(exc).__name__)
            raise


async def _serve(worker: Worker, **kwargs) -> StreamServer:
    return StreamServer({"generate": worker.generate}, StreamCodec(KEY), "127.0.0.1", **kwargs).start()


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_chunks_arrive_in_order_and_the_call_ends():
    async def main():
        worker = Worker()
        server = await _serve(worker)
        streams = WorkerStreams(StreamCodec(KEY))
        try:
            calls = [streams.call(server.address, _request(5, f"r{i}")) for i in range(8)]
            outs = await asyncio.gather(*[_collect(c) for c in calls])
            for chunks in outs:
                assert [c.token_ids[0] for c in chunks] == [100, 101, 102, 103, 104]
                assert chunks[-1].finished and chunks[-1].finish_reason == "length"
                assert chunks[0].route == "local"
            await _until(lambda: not server.calls)
            assert worker.closed == ["finished"] * 8 and not server.rejected
        finally:
            streams.close()
            server.close()

    asyncio.run(main())


async def _collect(call) -> list[GenerateChunk]:
    return [chunk async for chunk in call]


def test_cancel_closes_the_worker_generator():
    async def main():
        worker = Worker(delay_s=0.05)
        server = await _serve(worker)
        streams = WorkerStreams(StreamCodec(KEY))
        try:
            call = streams.call(server.address, _request(1000))
            first = await call.__anext__()
            assert first.token_ids == [100]
            call.cancel()
            await _until(lambda: worker.closed)
            assert worker.closed == ["CancelledError"] and not server.calls
            with pytest.raises(StopAsyncIteration):
                await call.__anext__()
        finally:
            streams.close()
            server.close()

    asyncio.run(main())


def test_prefill_method_returns_one_result_and_cancels():
    from workers.protocol import PrefillRequest, PrefillResult

    gate = asyncio.Event()
    seen: list[str] = []

    async def prefill(req: PrefillRequest):
        seen.append(req.transfer_id)
        try:
            if req.transfer_id == "slow":
                await gate.wait()
            yield PrefillResult(num_cached_tokens=16, num_bytes=1 << 20, seconds=0.01)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    def request(transfer_id: str) -> PrefillRequest:
        return PrefillRequest(request_id="r", transfer_id=transfer_id, prompt_token_ids=[1, 2, 3],
                              params=SamplingParams(max_tokens=4), seed=3, decode_address="tcp://127.0.0.1:1",
                              start_block=0, layout_fingerprint="fp", deadline=None)

    async def main():
        server = StreamServer({"generate": Worker().generate, "prefill": prefill}, StreamCodec(KEY),
                              "127.0.0.1").start()
        generate_only = await _serve(Worker())
        streams = WorkerStreams(StreamCodec(KEY), ping_interval_s=0.1, silence_timeout_s=0.5)
        try:
            replies = await _collect(streams.call(server.address, request("t1"), "prefill"))
            assert replies == [PrefillResult(16, 1 << 20, 0.01)]
            slow = streams.call(server.address, request("slow"), "prefill")
            await _until(lambda: "slow" in seen)
            slow.cancel()
            await _until(lambda: "cancelled" in seen)
            assert server.calls_total == {"prefill": 2}
            refused = streams.call(generate_only.address, request("t2"), "prefill")
            with pytest.raises(WorkerCallFailed, match="no method"):  # a decode replica has none: told at once
                await asyncio.wait_for(refused.__anext__(), 5)
            assert generate_only.rejected["rejected"] == 1
        finally:
            streams.close()
            server.close()
            generate_only.close()

    asyncio.run(main())


def test_a_failing_generate_reaches_the_router():
    async def main():
        server = await _serve(Worker(fail=True))
        streams = WorkerStreams(StreamCodec(KEY))
        try:
            call = streams.call(server.address, _request(5))
            assert (await call.__anext__()).token_ids == [100]
            with pytest.raises(WorkerCallFailed, match="engine exploded"):
                await call.__anext__()
        finally:
            streams.close()
            server.close()

    asyncio.run(main())


def test_a_router_without_the_key_is_refused_and_times_out():
    async def main():
        worker = Worker()
        server = await _serve(worker)
        streams = WorkerStreams(StreamCodec("another-key-0123456789abcdef"), ping_interval_s=0.1,
                                silence_timeout_s=0.5)
        try:
            call = streams.call(server.address, _request(3))
            with pytest.raises(ReplicaGone, match="stopped answering"):
                await asyncio.wait_for(call.__anext__(), 5)
            assert not worker.started.is_set() and server.rejected["auth"] >= 1
        finally:
            streams.close()
            server.close()

    asyncio.run(main())


def test_replayed_and_stale_messages_are_refused():
    async def main():
        worker = Worker()
        server = await _serve(worker)
        codec = StreamCodec(KEY)
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(server.address)
        try:
            opened = {"t": OPEN, "m": "generate", "id": 7, "req": to_wire(_request(2)), "s": "sess", "n": 1,
                      "ts": time.time()}
            await sock.send_multipart(codec.seal(opened))
            replies = [codec.open(await sock.recv_multipart()) for _ in range(3)]
            assert [r["t"] for r in replies] == ["chunk", "chunk", "end"]
            await sock.send_multipart(codec.seal(opened))  # the same bytes again
            await sock.send_multipart(codec.seal({**opened, "n": 2, "ts": time.time() - 3600}))
            await _until(lambda: server.rejected["rejected"] == 2)
            assert worker.closed == ["finished"]  # ran once
        finally:
            sock.close(linger=0)
            ctx.term()
            server.close()

    asyncio.run(main())


def _serve_forever(address_queue) -> None:
    async def main():
        server = StreamServer({"generate": Worker(delay_s=0.02).generate}, StreamCodec(KEY), "127.0.0.1").start()
        address_queue.put(server.address)
        await asyncio.sleep(3600)

    asyncio.run(main())


def test_a_killed_worker_process_fails_its_calls_at_once():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_serve_forever, args=(queue,), daemon=True)
    proc.start()

    async def main():
        streams = WorkerStreams(StreamCodec(KEY))
        try:
            call = streams.call(queue.get(timeout=60), _request(100000))
            await call.__anext__()
            os.kill(proc.pid, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(ReplicaGone, match="closed"):
                async for _ in call:
                    pass
            assert time.monotonic() - start < 2.0  # the connection closing, not the ping timeout
            assert not streams.peers  # the next call dials afresh
        finally:
            streams.close()

    try:
        asyncio.run(main())
    finally:
        proc.kill()
        proc.join(10)


@pytest.mark.parametrize("connection", ["closed", "silent"])
def test_a_vanished_router_has_its_calls_cancelled(connection):
    async def main():
        worker = Worker(delay_s=0.02)
        server = await _serve(worker, session_timeout_s=0.5)
        streams = WorkerStreams(StreamCodec(KEY))
        try:
            call = streams.call(server.address, _request(100000))
            await call.__anext__()
            for peer in list(streams.peers.values()):  # the router process is gone: no cancel
                for task in peer.tasks:
                    task.cancel()
                if connection == "closed":
                    peer.sock.close(linger=0)
            await _until(lambda: worker.closed, timeout_s=5.0)
            # a closed router: the next send fails and closes the generator (GeneratorExit);
            # a silent one (a lost machine): no ping for session_timeout_s cancels the call
            want = "GeneratorExit" if connection == "closed" else "CancelledError"
            assert worker.closed == [want] and not server.calls
        finally:
            streams.close()
            server.close()

    asyncio.run(main())


def test_retain_closes_only_idle_peers_the_view_dropped():
    async def main():
        server = await _serve(Worker(delay_s=0.01))
        streams = WorkerStreams(StreamCodec(KEY))
        try:
            call = streams.call(server.address, _request(20))
            await call.__anext__()
            streams.retain(set())  # a draining replica left the registry: its call goes on
            assert len(await _collect(call)) == 19 and server.address in streams.peers
            streams.retain(set())
            assert not streams.peers
        finally:
            streams.close()
            server.close()

    asyncio.run(main())


def test_a_draining_worker_finishes_open_calls_and_refuses_new_ones():
    async def main():
        worker = Worker(delay_s=0.02)
        server = await _serve(worker)
        streams = WorkerStreams(StreamCodec(KEY))
        try:
            open_call = streams.call(server.address, _request(20))
            await open_call.__anext__()
            drained = asyncio.ensure_future(server.drain(timeout_s=10))
            await asyncio.sleep(0.05)
            with pytest.raises(ReplicaGone, match="shutting down"):  # dispatch retries elsewhere
                await streams.call(server.address, _request(3, "late")).__anext__()
            assert len(await _collect(open_call)) == 19
            assert await drained == 0 and worker.closed == ["finished"]
            stuck = StreamServer({"generate": Worker(delay_s=1.0).generate}, StreamCodec(KEY), "127.0.0.1").start()
            streams.call(stuck.address, _request(100))
            await _until(lambda: stuck.calls)
            assert await stuck.drain(timeout_s=0.2) == 1  # gives up after its budget
            stuck.close()
        finally:
            streams.close()
            server.close()

    asyncio.run(main())
