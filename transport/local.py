"""The `local` backend: prefill and decode engines in one process (colocated use, tests).

No sockets and no MAC (nothing crosses a trust boundary), but the same `TransferTable`
rules: announced ids only, layers in order, shapes checked, failures cancel the
reservation. Layers are handed to a worker thread so the prefill engine's step never
runs the decode engine's copy (or waits on its lock).
"""

from __future__ import annotations

import itertools
import queue
import threading
import weakref

import torch

from transport.base import (
    KVSender,
    PeerGone,
    SenderSink,
    TransferAborted,
    TransferError,
)
from transport.config import TransportConfig
from transport.metrics import TransportMetrics
from transport.transfers import TableReceiver, TransferTable
from transport.wire import DONE, INLINE, LAYER, Header, done_header
from workers.engine.kv_types import FirstToken, KVLayout, KVTarget
from workers.engine.sequence import TokenLogprob

_RECEIVERS: weakref.WeakValueDictionary[str, LocalReceiver] = weakref.WeakValueDictionary()
_NAMES = itertools.count()


class LocalReceiver(TableReceiver):
    backend = "local"

    def __init__(self, config: TransportConfig, target: KVTarget,
                 metrics: TransportMetrics | None = None) -> None:
        self.metrics = metrics or TransportMetrics()
        self.table = TransferTable(target, config.bounds, self.metrics, config.reservation_ttl)
        self._name = f"r{next(_NAMES)}"
        self._inbox: queue.SimpleQueue[tuple[LocalSink, Header, torch.Tensor | None] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kv-recv-local", daemon=True)
        self._thread.start()
        _RECEIVERS[self._name] = self

    @property
    def address(self) -> str:
        return f"local://{self._name}"

    def close(self) -> None:
        _RECEIVERS.pop(self._name, None)
        self._inbox.put(None)
        self._thread.join(timeout=5)
        self.table.fail_all(lambda tid: TransferAborted("receiver closed", "closed", tid))

    def submit(self, sink: LocalSink, header: Header, kv: torch.Tensor | None) -> None:
        self._inbox.put((sink, header, kv))

    def _run(self) -> None:
        while True:
            try:
                item = self._inbox.get(timeout=0.2)
            except queue.Empty:
                self.table.expire()
                continue
            if item is None:
                return
            self._handle(*item)
            self.table.expire()

    def _handle(self, sink: LocalSink, header: Header, kv: torch.Tensor | None) -> None:
        try:
            t = self.table.begin(header, id(sink).to_bytes(8, "little"))
        except TransferError as exc:
            self.metrics.rejected(exc.reason)
            sink.fail(exc)
            return
        if header.seq == 0:  # the sender learns of a receiver-side failure (e.g. expiry)
            t.future.add_done_callback(lambda f: f.exception() and sink.fail(f.exception()))
        try:
            if header.kind == LAYER:
                shape = self.table.check_layer(t, header)
                self.table.write(t, header, kv.reshape(shape), None)  # in-process: nothing to verify
            elif header.kind == DONE:
                self.table.complete(t, header)
                sink.succeed()
            else:
                self.table.fail(header.transfer_id, TransferAborted(header.detail, header.reason))
        except TransferError as exc:
            self.metrics.rejected(exc.reason)
            self.table.fail(header.transfer_id, exc)
            sink.fail(exc)


class LocalSink(SenderSink):
    data_path = "local"

    def __init__(self, transfer_id: str, layout: KVLayout, start_block: int,
                 receiver: LocalReceiver) -> None:
        super().__init__(transfer_id, layout, start_block)
        self._receiver = receiver
        self._fingerprint = layout.fingerprint()
        self._seq = itertools.count()

    def new_digest(self) -> None:
        return None  # the tensor never leaves this process

    def on_layer(self, layer_idx: int, kv: torch.Tensor, checksum: int | None = None) -> None:
        if self.done:
            return
        self.layer_handed(kv)
        layout = self.layout
        self._receiver.submit(self, Header(
            LAYER, self.transfer_id, next(self._seq), layer_idx, layer_idx + 1, layout.dtype,
            [1, *kv.shape], layout.block_size, self._fingerprint,
            kv.numel() * kv.element_size(), data_path=INLINE), kv)

    def on_complete(self, first_token_id: int, logprob: TokenLogprob | None = None,
                    siblings: tuple[FirstToken, ...] = ()) -> None:
        if not self.done:
            self._receiver.submit(self, done_header(self.transfer_id, next(self._seq), first_token_id, logprob,
                                                    tuple(siblings)), None)

    def on_abort(self, reason: str) -> None:
        if self.fail(TransferAborted(f"prefill aborted: {reason}", "prefill_abort",
                                     self.transfer_id)):
            self._receiver.submit(self, Header("abort", self.transfer_id, next(self._seq),
                                               reason="prefill_abort", detail=reason), None)


class LocalSender(KVSender):
    backend = "local"

    def __init__(self, config: TransportConfig) -> None:
        super().__init__()
        self.config = config
        self._sinks: weakref.WeakSet[LocalSink] = weakref.WeakSet()

    def open(self, transfer_id: str, peer_address: str, layout: KVLayout,
             start_block: int = 0, timeout: float | None = None) -> SenderSink:
        receiver = _RECEIVERS.get(peer_address.removeprefix("local://"))
        sink = self.track(LocalSink(transfer_id, layout, start_block, receiver), peer_address)
        if receiver is None:
            sink.fail(PeerGone(f"no local receiver at {peer_address}", transfer_id=transfer_id))
        self._sinks.add(sink)
        return sink

    def close(self) -> None:
        for sink in list(self._sinks):
            sink.fail(TransferAborted("sender closed", transfer_id=sink.transfer_id))
