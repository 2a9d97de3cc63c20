"""Config -> backend: the only place that knows which classes make up each backend.

Every network backend shares the ZMQ control plane and differs in the data paths it
accepts (receiver) or prefers (sender):

| backend | receiver accepts | sender sends                                             |
|---------|------------------|----------------------------------------------------------|
| zmq     | inline           | inline                                                   |
| shm     | inline, shm      | shm when the peer is on this node, else inline           |
| nccl    | inline, pg       | pg (NCCL on CUDA, Gloo on CPU) when the peer accepts it  |
| auto    | inline, shm, pg  | shm on the same node; pg with CUDA; else inline          |
| local   | in-process only  | in-process only                                          |
"""

from __future__ import annotations

import torch

from transport.address import PeerAddress, default_node_id, reachable_host
from transport.base import KVReceiver, KVSender, KVTarget
from transport.config import TransportConfig
from transport.cuda_ipc import cuda_ipc_for
from transport.datapath import InlineRecvPath, InlineSendPath, RecvPath, SendPath
from transport.local_backend import LocalReceiver, LocalSender
from transport.metrics import TransportMetrics
from transport.nccl_backend import PgRecvPath, PgSendPath
from transport.shm_backend import ShmRecvPath, ShmSendPath, shm_available
from transport.wire import PG, SHM
from transport.zmq_backend import ZmqReceiver, ZmqSender

_RECV_PATHS = {"zmq": (), "shm": (SHM,), "nccl": (PG,), "auto": (SHM, PG)}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def make_receiver(config: TransportConfig, target: KVTarget,
                  metrics: TransportMetrics | None = None) -> KVReceiver:
    """The decode side's receiver, bound and serving; `.address` is what to advertise."""
    if config.backend == "local":
        return LocalReceiver(config, target, metrics)
    paths: list[RecvPath] = [InlineRecvPath()]
    for name in _RECV_PATHS[config.backend]:
        if name == SHM and shm_available():
            paths.append(ShmRecvPath(cuda_ipc_for(_device())))
        elif name == PG:
            paths.append(PgRecvPath(config.connect_timeout_s, _device()))
    receiver = ZmqReceiver(config, target, paths, metrics)
    receiver.backend = config.backend
    return receiver


def make_sender(config: TransportConfig, metrics: TransportMetrics | None = None) -> KVSender:
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
        return InlineSendPath()

    sender = ZmqSender(config, choose_path, metrics)
    sender.backend = backend
    return sender
