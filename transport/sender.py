"""The sending half of the ZMQ control plane, shared by every network backend.

One `PeerChannel` per (receiver, data path): its thread owns the DEALER socket and the
data path's sending half. `choose_path` picks the path per peer (see `transport.factory`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import zmq

from transport.address import PeerAddress
from transport.base import KVSender, SenderSink
from transport.channel import PeerChannel
from transport.config import TransportConfig
from transport.export_pool import ExportPool
from transport.metrics import TransportMetrics
from transport.paths.base import SendPath
from transport.paths.inline import InlineSendPath
from transport.wire import WireCodec
from workers.engine.kv_types import KVLayout


class ZmqSender(KVSender):
    """Opens sinks over per-peer channels; `choose_path` picks the data path per peer."""

    backend = "zmq"

    def __init__(self, config: TransportConfig, key: bytes,
                 choose_path: Callable[[PeerAddress], SendPath] | None = None,
                 metrics: TransportMetrics | None = None) -> None:
        super().__init__()
        self.config = config
        self.metrics = metrics or TransportMetrics()
        self.codec = WireCodec(key, config.wire_limits)
        self._choose_path = choose_path or (lambda addr: InlineSendPath())
        # Host buffers the engine exports layers into, reused once a send is done with one.
        self.export_pool = ExportPool()
        self._ctx = zmq.Context(io_threads=1)
        self._channels: dict[tuple[str, str], PeerChannel] = {}
        self._lock = threading.Lock()

    def open(self, transfer_id: str, peer_address: str, layout: KVLayout,
             start_block: int = 0, timeout: float | None = None) -> SenderSink:
        address = PeerAddress.parse(peer_address)
        channel = self._channel(address)
        return self.track(channel.open_sink(transfer_id, layout, start_block,
                                            timeout or self.config.transfer_timeout_s), peer_address)

    def _channel(self, address: PeerAddress) -> PeerChannel:
        path = self._choose_path(address)
        key = (address.endpoint, path.name)
        with self._lock:
            channel = self._channels.get(key)
            if channel is None or channel.broken:
                channel = PeerChannel(self._ctx, address, path, self.codec, self.metrics,
                                      self.config.connect_timeout_s, self.export_pool)
                self._channels[key] = channel
            else:
                path.close()
            return channel

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            channel.stop()
        self._ctx.term()
