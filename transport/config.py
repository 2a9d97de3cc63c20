"""`TransportConfig`: the cluster config's `transport:` section, and what every backend is
built from (transport/factory.py).

This module imports nothing heavy (no torch): `cluster/config.py`, the pure schema, imports
it. The shared key is not part of it: a secret does not belong in a file users write and
pass around. The app builder resolves the key once (`cluster.app.transport_key`) and every
sender and receiver takes it as a value.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from transport.transfers import Bounds
    from transport.wire import WireLimits

Backend = Literal["zmq", "nccl", "shm", "local", "auto"]


class TransportConfig(BaseModel):
    """Every option of the KV transport, with its default; docs/transport.md lists them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # zmq: ZMQ control, payloads over TCP; shm: same-node shared memory, else as zmq;
    # nccl: a process group per pair (Gloo on CPU); auto: shm on one node, nccl with CUDA,
    # else zmq; local: in-process (colocated use, tests). Table in transport/factory.py.
    backend: Backend = "auto"
    # Bind address. None: this node's reachable IP (Ray's node IP or the default route's
    # source), which is also what is advertised. "0.0.0.0" binds everywhere and still
    # advertises the reachable IP. Never a hard-coded localhost; tests use "127.0.0.1".
    host: str | None = None
    port: int = Field(0, ge=0, le=65535)  # ZMQ control; 0 = a free port, the real one is advertised
    # zmq/shm/auto: move payloads between nodes over a per-pair TCP stream read straight into
    # the KV blocks (the `tcp` data path) rather than in ZMQ frames. Off with `curve` (its
    # payload is not encrypted). `data_port`: its listening port on `host`, 0 = a free one.
    direct_tcp: bool = True
    data_port: int = Field(0, ge=0, le=65535)
    curve: bool = False  # CurveZMQ encryption of the control plane and inline payloads
    connect_timeout_s: float = Field(5.0, gt=0)  # connect, handshake, a silent data stream
    transfer_timeout_s: float = Field(30.0, gt=0)  # sender: open -> receiver's ack
    reservation_ttl_s: float | None = Field(None, gt=0)  # receiver: expect -> complete; None: transfer_timeout_s
    max_layer_bytes: int = Field(1 << 30, gt=0)
    max_blocks_per_transfer: int = Field(1 << 16, gt=0)
    max_header_bytes: int = Field(16 << 10, ge=1024)
    shm_pool_bytes: int = Field(4 << 30, gt=0)  # per peer, same-node slots in flight
    # A file holding the shared key (first in the order `cluster.app.transport_key` reads).
    key_file: str | None = None
    # Which processes count as one node for shared memory. None: hostname + kernel boot id;
    # a worker sets Ray's node id (workers/kv_transport.py).
    node_id: str | None = None

    @property
    def reservation_ttl(self) -> float:
        return self.reservation_ttl_s or self.transfer_timeout_s

    @property
    def bounds(self) -> Bounds:
        from transport.transfers import Bounds

        return Bounds(self.max_layer_bytes, self.max_blocks_per_transfer)

    @property
    def wire_limits(self) -> WireLimits:
        from transport.wire import WireLimits

        return WireLimits(max_header_bytes=self.max_header_bytes)


def generate_key() -> str:
    """A fresh random key, for a launcher that hands the same key to every replica."""
    return secrets.token_urlsafe(32)
