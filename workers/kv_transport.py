"""A worker's KV sender or receiver, and its worker-stream codec, from the cluster config
and the transport key the app builder handed it (`cluster.app.transport_key`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cluster.config import ClusterConfig
from transport.config import TransportConfig
from workers.stream.wire import StreamCodec

if TYPE_CHECKING:
    from transport.base import KVReceiver, KVSender
    from workers.engine.kv_types import KVTarget


def make_receiver(config: ClusterConfig, target: KVTarget, key: str | None) -> KVReceiver:
    from transport.factory import make_receiver as build

    return build(_on_this_node(config), target, _required(key))


def make_sender(config: ClusterConfig, key: str | None) -> KVSender:
    from transport.factory import make_sender as build

    return build(_on_this_node(config), _required(key))


def stream_codec(key: str | None) -> StreamCodec:
    """The worker stream's codec (workers/stream/wire.py), keyed like the KV transport."""
    return StreamCodec(_required(key))


def stream_host(config: ClusterConfig) -> str:
    """Where a worker's stream server binds: the transport's host, else the node's IP."""
    from transport.address import reachable_host

    return reachable_host(config.transport.host)


def _required(key: str | None) -> bytes:
    if not key:
        raise ValueError("no transport key: cluster.app.build_app hands one to every replica")
    return key.encode()


def _on_this_node(config: ClusterConfig) -> TransportConfig:
    """The transport section with Ray's node id as the node identity (unless the config
    names one): shared memory only between replicas of one Ray node (several raylets on
    one machine, as in multi-node tests, use TCP)."""
    return config.transport.model_copy(update={"node_id": config.transport.node_id or _ray_node_id()})


def _ray_node_id() -> str | None:
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - outside Ray
        return None
