"""The `nccl` data path: ZMQ headers, payload over a per-pair torch.distributed group.

No global `init_process_group`: on first contact the sender starts a `TCPStore` on its own
reachable address and sends an authenticated HELLO naming it; both sides then build a
2-rank group over a `PrefixStore` — `ProcessGroupNCCL` for CUDA tensors,
`ProcessGroupGloo` on CPU, so CPU tests run this exact path. Each LAYER header is
followed by one point-to-point send of the layer; the receiver allocates the buffer only
after the header passed every check, so a peer cannot make it allocate beyond its bounds.

The authenticated header carries an xxh3 checksum of CPU payloads. For CUDA payloads the
checksum is skipped (hashing on the host would cost a device copy); the group itself was
set up through an authenticated handshake.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import Future
from datetime import timedelta

import torch
from torch.distributed import PrefixStore, TCPStore

from transport.base import PeerGone, TransferCorrupt
from transport.paths.base import Received, RecvPath, Reply, SendPath, tensor_bytes
from transport.wire import HELLO, PG, Header, payload_checksum

_TAG = 0  # one ordered stream per pair: headers on ZMQ and sends here line up one to one


def make_pair_group(store, rank: int, device: str, host: str, timeout_s: float):
    """A 2-rank process group for one (sender, receiver) pair."""
    timeout = timedelta(seconds=timeout_s)
    if device == "cuda":
        from torch.distributed import ProcessGroupNCCL

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, opts)
    from torch.distributed import ProcessGroupGloo

    opts = ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
    return ProcessGroupGloo(store, rank, 2, opts)


class PgSendPath(SendPath):
    name = PG

    def __init__(self, host: str, timeout_s: float, device: str = "cpu") -> None:
        self.host, self.timeout_s, self.device = host, timeout_s, device
        self.broken = False
        self._group: Future = Future()
        self._store: TCPStore | None = None

    def hello(self) -> Header:
        group = f"pdc-kv-{os.urandom(8).hex()}"
        self._store = TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=self.timeout_s))
        threading.Thread(target=self._build, args=(group,), daemon=True,
                         name="kv-pg-setup").start()
        return Header(HELLO, "", data_path=PG, extra={
            "store_host": self.host, "store_port": self._store.port, "group": group,
            "device": self.device})

    def _build(self, group: str) -> None:
        try:
            self._group.set_result(make_pair_group(PrefixStore(group, self._store), 0,
                                                   self.device, self.host, self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - reported to the next send
            self._group.set_exception(exc)

    def payload(self, header: Header, kv: torch.Tensor, checksum: int | None = None) -> list:
        if kv.is_cuda:
            header.checksum = 0
        else:
            header.checksum = payload_checksum(tensor_bytes(kv.contiguous())) if checksum is None else checksum
        return []

    def after_send(self, header: Header, kv: torch.Tensor) -> None:
        try:
            group = self._group.result(self.timeout_s)
            tensor = kv.contiguous() if self.device == "cuda" else kv.detach().cpu().contiguous()
            group.send([tensor], 1, _TAG).wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - the pair's stream is now out of step
            self.broken = True
            raise PeerGone(f"process-group send failed: {type(exc).__name__}: {exc}",
                           "pg_send", header.transfer_id) from None

    def on_transfer_end(self, transfer_id: str) -> None:
        pass

    def close(self) -> None:
        self._group.cancel()
        self._store = None


def _numel_within(header: Header, max_bytes: int) -> int:
    """Elements of the payload the header describes, if it is within `max_bytes`; else ValueError."""
    dtype = getattr(torch, header.dtype, None) if isinstance(header.dtype, str) else None
    dims = header.shape if isinstance(header.shape, list) else None
    if not isinstance(dtype, torch.dtype) or not dims or not all(isinstance(d, int) and d >= 0 for d in dims):
        raise ValueError("the header does not describe its payload")
    numel = math.prod(dims)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if nbytes != header.nbytes or nbytes > max_bytes:
        raise ValueError(f"payload of {header.nbytes} bytes cannot be received safely")
    return numel


class PgRecvPath(RecvPath):
    name = PG
    blocking = True

    def __init__(self, timeout_s: float, device: str = "cpu") -> None:
        self.timeout_s, self.device = timeout_s, device
        self._groups: dict[bytes, object] = {}
        # Per peer, a reusable host buffer for received layers: a fresh one per layer lands
        # in new memory (a page fault per 4 KiB) and halved the speed of 32 MiB layers. A
        # peer's messages are handled one at a time, each copied out before the next.
        self._scratch: dict[bytes, torch.Tensor] = {}
        self._lock = threading.Lock()

    def on_hello(self, peer: bytes, header: Header, reply: Reply) -> None:
        host, port, group = (header.extra.get(k) for k in ("store_host", "store_port", "group"))
        if not (isinstance(host, str) and isinstance(port, int) and 0 < port < 65536
                and isinstance(group, str) and group.startswith("pdc-kv-")):
            raise TransferCorrupt("bad process-group handshake", "malformed")
        device = "cuda" if header.extra.get("device") == "cuda" and self.device == "cuda" else "cpu"
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self.timeout_s))
        pg = make_pair_group(PrefixStore(group, store), 1, device, _local_host_for(host),
                             self.timeout_s)
        with self._lock:
            self._groups[peer] = (pg, device)

    def read(self, peer: bytes, header: Header, frames: list, shape: tuple[int, ...],
             reply: Reply) -> Received:
        with self._lock:
            entry = self._groups.get(peer)
        if entry is None or frames:
            raise TransferCorrupt(f"{header.transfer_id!r}: no process group with this peer",
                                  "malformed", header.transfer_id)
        pg, device = entry
        buf = self._buffer(peer, getattr(torch, header.dtype), tuple(shape), device)
        try:
            pg.recv([buf], 0, _TAG).wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:  # noqa: BLE001 - sender died or stalled mid-layer
            with self._lock:
                self._groups.pop(peer, None)
                self._scratch.pop(peer, None)
            raise PeerGone(f"process-group receive failed: {type(exc).__name__}",
                           "pg_recv", header.transfer_id) from None
        return Received(buf, header.checksum if device == "cpu" else None)

    def discard(self, peer: bytes, header: Header, max_bytes: int) -> None:
        """Receive a refused layer into scratch memory: the sender posts its send whatever
        we think of the header, and an unmatched send would hold its channel until the
        timeout. A payload we cannot receive safely (beyond `max_bytes`, or a header that
        does not describe it) drops the pair's group instead: the sender's send then fails
        at its timeout and it sets up a fresh group."""
        with self._lock:
            entry = self._groups.get(peer)
        if entry is None:
            return
        pg, device = entry
        try:
            numel = _numel_within(header, max_bytes)
            buf = self._buffer(peer, getattr(torch, header.dtype), (numel,), device)
            pg.recv([buf], 0, _TAG).wait(timedelta(seconds=self.timeout_s))
        except Exception:  # noqa: BLE001 - out of step now: never reuse this group
            with self._lock:
                self._groups.pop(peer, None)
                self._scratch.pop(peer, None)

    def _buffer(self, peer: bytes, dtype: torch.dtype, shape: tuple[int, ...], device: str) -> torch.Tensor:
        if device != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)  # the caching allocator reuses
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        with self._lock:
            scratch = self._scratch.get(peer)
            if scratch is None or scratch.numel() < nbytes:
                scratch = self._scratch[peer] = torch.empty(nbytes, dtype=torch.uint8)
        return scratch[:nbytes].view(dtype).view(shape)

    def close(self) -> None:
        with self._lock:
            self._groups.clear()
            self._scratch.clear()


def _local_host_for(peer_host: str) -> str:
    """The local address Gloo should bind for traffic with `peer_host`."""
    import socket

    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((peer_host, 1))
        return probe.getsockname()[0]
    except OSError:
        return peer_host
    finally:
        probe.close()
