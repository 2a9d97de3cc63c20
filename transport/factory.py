"""Config -> backend: the only place that knows which classes make up each backend.

Every network backend shares the ZMQ control plane and differs in the data paths it
accepts (receiver) or prefers (sender):

| backend | receiver accepts      | sender sends                                          |
|---------|-----------------------|-------------------------------------------------------|
| zmq     | inline, tcp           | tcp when the peer accepts it, else inline             |
| shm     | inline, shm, tcp      | shm when the peer is on this node, else as zmq        |
| nccl    | inline, pg            | pg (NCCL on CUDA, Gloo on CPU) when the peer accepts it |
| auto    | inline, shm, pg, tcp  | shm on the same node; pg with CUDA; else as zmq       |
| local   | in-process only       | in-process only                                       |

`tcp` is offered and used only with `direct_tcp` on and `curve` off (its payload is not
encrypted).
"""

from __future__ import annotations

import torch

from transport.address import PeerAddress, default_node_id, reachable_host
from transport.base import KVReceiver, KVSender
from transport.config import TransportConfig
from transport.local import LocalReceiver, LocalSender
from transport.metrics import TransportMetrics
from transport.paths.base import RecvPath, SendPath
from transport.paths.cuda_ipc import cuda_ipc_for
from transport.paths.inline import InlineRecvPath, InlineSendPath
from transport.paths.pg import PgRecvPath, PgSendPath
from transport.paths.shm import ShmRecvPath, ShmSendPath, shm_available
from transport.paths.tcp import TcpRecvPath, TcpSendPath
from transport.receiver import ZmqReceiver
from transport.sender import ZmqSender
from transport.wire import PG, SHM, TCP
from workers.engine.kv_types import KVTarget

_RECV_PATHS = {"zmq": (TCP,), "shm": (SHM, TCP), "nccl": (PG,), "auto": (SHM, PG, TCP)}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_receiver(config: TransportConfig, target: KVTarget, key: bytes,
                  metrics: TransportMetrics | None = None) -> KVReceiver:
    """The decode side's receiver, bound and serving; `.address` is what to advertise.
    `key`: the shared key every header and data connection is authenticated with."""
    if config.backend == "local":
        return LocalReceiver(config, target, metrics)
    metrics = metrics or TransportMetrics()
    paths: list[RecvPath] = [InlineRecvPath()]
    for name in _RECV_PATHS[config.backend]:
        if name == SHM and shm_available():
            paths.append(ShmRecvPath(cuda_ipc_for(_device())))
        elif name == PG:
            paths.append(PgRecvPath(config.connect_timeout_s, _device()))
        elif name == TCP and _direct_tcp(config):
            paths.append(TcpRecvPath(config.host or reachable_host(None), config.data_port,
                                     key, config.connect_timeout_s,
                                     metrics.rejected))
    receiver = ZmqReceiver(config, target, key, paths, metrics)
    receiver.backend = config.backend
    return receiver


def make_sender(config: TransportConfig, key: bytes, metrics: TransportMetrics | None = None) -> KVSender:
    """The prefill side's sender; one per process, shared by all requests."""
    if config.backend == "local":
        return LocalSender(config)
    node_id = config.node_id or default_node_id()
    host = reachable_host(config.host)
    backend, device = config.backend, _device()

    def choose_path(peer: PeerAddress) -> SendPath:
        same_node = peer.node_id == node_id and shm_available()
        if backend in ("shm", "auto") and same_node and SHM in peer.data_paths:
            return ShmSendPath(config.shm_pool_bytes, cuda_ipc_for(device))
        wants_pg = backend == "nccl" or (backend == "auto" and device == "cuda")
        if wants_pg and PG in peer.data_paths:
            return PgSendPath(host, config.connect_timeout_s, device)
        if _direct_tcp(config) and TCP in peer.data_paths and not peer.curve_public_key:
            return TcpSendPath(peer, key, config.connect_timeout_s, config.transfer_timeout_s)
        return InlineSendPath()

    sender = ZmqSender(config, key, choose_path, metrics)
    sender.backend = backend
    return sender


def _direct_tcp(config: TransportConfig) -> bool:
    return config.direct_tcp and not config.curve
