"""`pdcluster bench transport`: KV transfer throughput against its peers and baselines.

Every figure is the median of repeated transfers between two processes, timed on the
sending side from the first byte handed over to the receiver's acknowledgement (which it
sends once the data sits in its KV blocks); the methods of one size take turns, one
transfer each per round, so a shared machine's changing load weighs on all of them alike.
GB/s = 1e9 bytes/s. Payloads are streamed as 8 layers, like a real prompt. The rows are
`VARIANTS`: `zmq` as deployed (payload on the `tcp` data path, read straight into the
blocks), `zmq_inline` (payload in ZMQ frames), `zmq_curve`, `nccl` and `shm`;
`ratios_paired` gives the median of each round's own ratio beside the ratio of medians.
Baselines: a raw TCP socket carrying the same bytes into a preallocated buffer (the
loopback limit), Ray's object store (`ray.put` in one actor,
`ray.get` plus one copy into a destination in another, timed inside the actors so the
actor-call overhead is excluded) across two raylets (`ray_object_store`: the bytes cross
TCP, as zmq's do) and within one (`ray_object_store_same_node`: shared memory, as shm's
do), and a single in-process memcpy.

The layers are handed over as the prefill engine hands them: copied out of its blocks
with their payload checksum made during that copy (`copy_from_blocks`), prefill's work
before a layer's first byte is sent, so not in a transfer's time. `export` reports what
that copy costs with and without the checksum, and the checksum alone, into fresh tensors
and into a sender's reused export buffers (`pooled_*`); `export_by_mib` the same per size.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import socket
import statistics
import sys
import time
from collections.abc import Iterator

import torch

from cluster.bench.transport_export import export_cost, exported_layers
from cluster.bench.transport_ray import time_ray
from transport.config import TransportConfig
from transport.memory_target import MemoryTarget
from transport.paths.base import copy_bytes
from transport.paths.tcp_accept import tune
from workers.engine.kv_types import KVLayout

MIB = 1 << 20
NUM_LAYERS = 8
BENCH_KEY = b"pdc-bench-transport-key-not-secret"


def bench_layout(dtype: str = "float32") -> KVLayout:
    # 8 layers x 128 KiB per block: 1 MiB per block across the stack.
    return KVLayout("bench", NUM_LAYERS, 8, 128, 16, dtype)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# What each transport row measures: a backend and the options it runs with. `zmq` is the
# backend as deployed (ZMQ headers, payload on the `tcp` data path straight into the
# blocks); `zmq_inline` carries the payload in ZMQ frames, as `curve` does.
VARIANTS: dict[str, tuple[str, dict]] = {
    "zmq": ("zmq", {}),
    "zmq_inline": ("zmq", {"direct_tcp": False}),
    "zmq_curve": ("zmq", {"curve": True}),
    "nccl": ("nccl", {}),
    "shm": ("shm", {}),
}


def _config(variant: str) -> TransportConfig:
    backend, options = VARIANTS[variant]
    return TransportConfig(backend=backend, host="127.0.0.1",
                           transfer_timeout_s=120, reservation_ttl_s=120, connect_timeout_s=60,
                           **options)


# -- the receiving process ---------------------------------------------------------------------

def _receiver_main(conn, layout_fields: tuple, num_blocks: int) -> None:
    torch.set_num_threads(1)
    from transport.factory import make_receiver

    layout = KVLayout(*layout_fields)
    target = MemoryTarget(layout, num_blocks)
    receivers = {}
    while (msg := conn.recv()) is not None:
        cmd, *args = msg
        if cmd == "start":
            (variant,) = args
            receivers[variant] = make_receiver(_config(variant), target, BENCH_KEY)
            conn.send(receivers[variant].address)
        elif cmd == "expect":
            variant, tid, n = args
            res = target.reserve(tid, n)
            receivers[variant].expect(tid, res)
            receivers[variant].future(tid).add_done_callback(lambda f, r=res: target.commit(r))
            conn.send("ok")
        elif cmd == "tcp":
            conn.send(_tcp_server_port(args[0]))
    for rx in receivers.values():
        rx.close()


class ReceiverProcess:
    def __init__(self, layout: KVLayout, num_blocks: int) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        fields = (layout.model_fingerprint, layout.num_layers, layout.num_kv_heads,
                  layout.head_dim, layout.block_size, layout.dtype)
        self.proc = ctx.Process(target=_receiver_main, args=(child, fields, num_blocks),
                                daemon=True)
        self.proc.start()

    def call(self, *msg):
        self.conn.send(msg)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(None)
        self.proc.join(30)


# -- transport backends ------------------------------------------------------------------------

def transport_timer(rx: ReceiverProcess, variant: str, layout: KVLayout,
                    layers: list[tuple[torch.Tensor, int]]) -> Iterator[float]:
    """Seconds of one more transfer of `layers` by `VARIANTS[variant]`, per `next()`; an
    untimed first transfer warms connections and buffers."""
    from transport.factory import make_sender

    address = rx.call("start", variant)
    sender = make_sender(_config(variant), BENCH_KEY)
    num_blocks = layers[0][0].shape[1]
    try:
        for i in itertools.count():
            tid = f"bench-{variant}-{num_blocks}-{i}"
            rx.call("expect", variant, tid, num_blocks)
            t0 = time.perf_counter()
            sink = sender.open(tid, address, layout)
            for layer_idx, (kv, checksum) in enumerate(layers):
                sink.on_layer(layer_idx, kv, checksum)
            sink.on_complete(0)
            sink.wait(120)
            if i:
                yield time.perf_counter() - t0
    finally:
        sender.close()


def time_transport(rx: ReceiverProcess, variant: str, layout: KVLayout, num_blocks: int,
                   repeats: int) -> list[float]:
    layers = exported_layers(layout, num_blocks)
    return interleaved({variant: transport_timer(rx, variant, layout, layers)}, repeats)[variant]


def interleaved(timers: dict[str, Iterator[float]], repeats: int) -> dict[str, list[float]]:
    """`repeats` rounds of one transfer per method, so load that comes and goes on a shared
    machine weighs on every method alike and their ratios stay meaningful."""
    times: dict[str, list[float]] = {name: [] for name in timers}
    try:
        for _ in range(repeats):
            for name, timer in timers.items():
                times[name].append(next(timer))
    finally:
        for timer in timers.values():
            timer.close()
    return times


# -- baselines ---------------------------------------------------------------------------------

def _tcp_server_port(nbytes: int) -> int:
    import threading

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)

    def serve() -> None:
        conn, _ = srv.accept()
        srv.close()
        tune(conn)
        view = memoryview(bytearray(nbytes))
        with conn:
            while _recv_exactly(conn, view):  # until the client closes
                conn.sendall(b"k")

    def _recv_exactly(conn: socket.socket, view: memoryview) -> bool:
        got = 0
        while got < len(view):
            n = conn.recv_into(view[got:])
            if not n:
                return False
            got += n
        return True

    threading.Thread(target=serve, daemon=True).start()
    return srv.getsockname()[1]


def raw_tcp_timer(rx: ReceiverProcess, nbytes: int) -> Iterator[float]:
    port = rx.call("tcp", nbytes)
    data = memoryview(bytearray(torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        tune(sock)  # TCP_NODELAY, as the `tcp` data path: the last segment never waits
        for i in itertools.count():
            t0 = time.perf_counter()
            sock.sendall(data)
            sock.recv(1)
            if i:
                yield time.perf_counter() - t0


def memcpy_timer(nbytes: int) -> Iterator[float]:
    """One single-threaded memcpy between warm buffers: the unit a same-node path pays
    twice. (`Tensor.copy_` would fan out to torch's thread pool and, on a busy machine,
    measure OpenMP barrier waits rather than memory.)"""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.ones_like(src)  # both buffers' pages present before the first timing
    for i in itertools.count():
        t0 = time.perf_counter()
        copy_bytes(dst, src)
        if i:
            yield time.perf_counter() - t0


# -- the whole run -----------------------------------------------------------------------------

def run(sizes_mib: list[int], repeats: int, with_ray: bool = True, with_curve: bool = True,
        with_overlap: bool = True) -> dict:
    layout = bench_layout()
    block_bytes = layout.layer_nbytes(1) * layout.num_layers
    results: list[dict] = []

    def add(name: str, nbytes: int, times: list[float]) -> None:
        median = statistics.median(times)
        results.append({"name": name, "bytes": nbytes, "gb_per_s": round(nbytes / median / 1e9, 4),
                        "median_s": round(median, 6), "repeats": len(times)})
        log(f"  {name:>18} {nbytes // MIB:>4} MiB  {nbytes / median / 1e9:7.3f} GB/s")

    paired: dict[str, float] = {}
    rx = ReceiverProcess(layout, max(sizes_mib) * MIB // block_bytes)
    try:
        for mib in sizes_mib:
            nbytes, num_blocks = mib * MIB, mib * MIB // block_bytes
            reps = max(1, repeats if mib < 256 else (repeats + 1) // 2)
            log(f"{mib} MiB ({reps} interleaved repeats)")
            layers = exported_layers(layout, num_blocks)
            timers = {variant: transport_timer(rx, variant, layout, layers)
                      for variant in ("zmq", "zmq_inline", "nccl", "shm")}
            if with_curve and mib <= 64:
                timers["zmq_curve"] = transport_timer(rx, "zmq_curve", layout, layers)
            timers["raw_tcp"] = raw_tcp_timer(rx, nbytes)
            timers["memcpy"] = memcpy_timer(nbytes)
            rounds = interleaved(timers, reps)
            for name, times in rounds.items():
                add(name, nbytes, times)
            paired.update(_paired_ratios(rounds, mib))
    finally:
        rx.close()
    if with_ray:
        for name, cross_node in (("ray_object_store", True), ("ray_object_store_same_node", False)):
            log(f"{name} ({'two raylets, over TCP' if cross_node else 'one raylet, shared memory'})")
            for nbytes, times in time_ray([m * MIB for m in sizes_mib], repeats, cross_node).items():
                add(name, nbytes, times)
    out = {"results": results, "ratios": _ratios(results, sizes_mib), "ratios_paired": paired}
    out["export_by_mib"] = {}
    for mib in sizes_mib:
        out["export_by_mib"][str(mib)] = export_cost(layout, mib * MIB // block_bytes, repeats)
        log(f"export of {mib} MiB (prefill side): {out['export_by_mib'][str(mib)]}")
    out["export"] = out["export_by_mib"][str(64 if 64 in sizes_mib else max(sizes_mib))]
    if with_overlap:
        out["overlap"] = measure_overlap()
    return out


def _paired_ratios(rounds: dict[str, list[float]], mib: int) -> dict[str, float]:
    """Per size, the median over rounds of each round's own speed ratio (the methods of a
    round ran back to back, so load that comes and goes between rounds cancels out)."""
    out = {}
    for a, b in (("zmq", "raw_tcp"), ("zmq_inline", "raw_tcp"), ("shm", "memcpy")):
        if rounds.get(a) and rounds.get(b):
            out[f"{a}_vs_{b}_{mib}MiB"] = round(statistics.median(
                tb / ta for ta, tb in zip(rounds[a], rounds[b], strict=True)), 3)
    return out


def _ratios(results: list[dict], sizes_mib: list[int]) -> dict[str, float]:
    mib = 64 if 64 in sizes_mib else max(sizes_mib)
    speed = {r["name"]: r["gb_per_s"] for r in results if r["bytes"] == mib * MIB}

    def ratio(a: str, b: str) -> float | None:
        return round(speed[a] / speed[b], 3) if a in speed and speed.get(b) else None

    # zmq is the cross-node transport, so its Ray peer is Ray's cross-node pull; the
    # same-node object store is shared memory, the peer of `shm` (both are reported).
    return {f"zmq_vs_raw_tcp_{mib}MiB": ratio("zmq", "raw_tcp"),
            f"zmq_inline_vs_raw_tcp_{mib}MiB": ratio("zmq_inline", "raw_tcp"),
            f"zmq_vs_ray_object_store_{mib}MiB": ratio("zmq", "ray_object_store"),
            f"shm_vs_memcpy_{mib}MiB": ratio("shm", "memcpy"),
            f"zmq_vs_ray_object_store_same_node_{mib}MiB": ratio("zmq", "ray_object_store_same_node"),
            f"shm_vs_ray_object_store_same_node_{mib}MiB": ratio("shm", "ray_object_store_same_node"),
            f"zmq_curve_vs_zmq_{mib}MiB": ratio("zmq_curve", "zmq_inline")}


def measure_overlap(prompt_len: int = 2000, backend: str = "zmq", preset: str = "small",
                    prefill_threads: int = 1) -> dict:
    """Prefill a prompt on the `small` preset with a sink streaming to another process; the
    exposed tail is KV-complete-on-decode minus prefill end.

    The prefill runs on `prefill_threads` torch threads, leaving a core to the transport
    and the receiver, as a prefill worker that streams KV is deployed. With every core given
    to torch, its OpenMP barriers wait on workers preempted by the transport threads (and
    by any other load): a 2,000-token prefill of ~7 s CPU was measured at 36-76 s wall.
    """
    threads_before = torch.get_num_threads()
    torch.set_num_threads(prefill_threads)
    try:
        out = _measure_overlap(prompt_len, backend, preset)
    finally:
        torch.set_num_threads(threads_before)
    return {**out, "prefill_threads": prefill_threads}


def _measure_overlap(prompt_len: int, backend: str, preset: str) -> dict:
    import tempfile
    from pathlib import Path

    from transport.factory import make_sender
    from workers.engine import LLMEngine, SamplingParams
    from workers.model_files import make_model

    log(f"overlap: {preset} preset, {prompt_len}-token prompt over {backend}")
    model_dir = make_model(Path(tempfile.mkdtemp(prefix="pdc-bench-")) / preset, preset, 0)
    engine = LLMEngine(str(model_dir), block_size=16, num_kv_blocks=prompt_len // 16 + 32,
                       max_num_batched_tokens=prompt_len + 16, device="cpu")
    layout = engine.layout
    num_blocks = layout.num_blocks(prompt_len)
    rx = ReceiverProcess(layout, num_blocks * 4)
    sender = make_sender(_config(backend), BENCH_KEY)
    try:
        address = rx.call("start", backend)
        prompt = [(31 * i + 7) % 250 for i in range(prompt_len)]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        timings = []
        for i in range(3):
            tid = f"overlap-{i}"
            rx.call("expect", backend, tid, num_blocks)
            sink = _TimedSink(sender.open(tid, address, layout))
            engine.add_request(tid, [p + i for p in prompt], params, kv_sink=sink)
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            prefill_end = time.perf_counter()
            sink.inner.wait(120)
            timings.append((prefill_end - t0, sink.acked_at() - prefill_end))
        one_layer = statistics.median(time_transport(
            rx, backend, layout, num_blocks, 3)) / layout.num_layers
        prefill_s, tail_s = statistics.median(t[0] for t in timings), statistics.median(
            t[1] for t in timings)
    finally:
        sender.close()
        rx.close()
    return {"prefill_ms": round(prefill_s * 1e3, 2), "tail_ms": round(tail_s * 1e3, 2),
            "one_layer_transfer_ms": round(one_layer * 1e3, 2),
            "tail_within_2x_layer": tail_s <= 2 * one_layer, "backend": backend,
            "prompt_tokens": prompt_len, "layer_bytes": layout.layer_nbytes(num_blocks)}


class _TimedSink:
    """Passes calls through; records when the receiver's acknowledgement arrived."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.start_block = inner.start_block
        self._acked: list[float] = []
        inner.result.add_done_callback(lambda f: self._acked.append(time.perf_counter()))

    def new_digest(self):
        return self.inner.new_digest()

    def export_buffer(self, nbytes: int) -> torch.Tensor | None:
        return self.inner.export_buffer(nbytes)

    def on_layer(self, layer_idx: int, kv: torch.Tensor, checksum: int | None = None) -> None:
        self.inner.on_layer(layer_idx, kv, checksum)

    def on_complete(self, first_token_id: int, logprob=None) -> None:
        self.inner.on_complete(first_token_id, logprob)

    def on_abort(self, reason: str) -> None:
        self.inner.on_abort(reason)

    def acked_at(self) -> float:
        return self._acked[0]


