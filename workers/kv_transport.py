"""Builds a worker's KV sender or receiver from the cluster config (the one place that
knows both `cluster.config.TransportSettings` and `transport.factory`)."""

from __future__ import annotations

from cluster.config import ClusterConfig


def transport_config(config: ClusterConfig, key: str | None):
    from transport.config import TransportConfig

    t = config.transport
    key = key or config.secrets.transport_key()
    fields = dict(backend=t.backend, host=t.host, port=t.port, direct_tcp=t.direct_tcp,
                  data_port=t.data_port, connect_timeout_s=t.connect_timeout_s,
                  transfer_timeout_s=t.transfer_timeout_s, reservation_ttl_s=t.transfer_timeout_s,
                  node_id=_ray_node_id())
    if t.key_file and not key:
        fields["key_file"] = t.key_file
    elif key:
        fields["key"] = key
    return TransportConfig(**fields)


def make_receiver(config: ClusterConfig, target, key: str | None):
    try:
        from transport.factory import make_receiver as build
    except ImportError:  # before the factory existed: the zmq backend
        from transport.receiver import ZmqReceiver as build
    return build(transport_config(config, key), target)


def stream_codec(config: ClusterConfig, key: str | None):
    """The worker stream's codec (workers/stream/wire.py), keyed like the KV transport."""
    from workers.stream.wire import StreamCodec

    return StreamCodec(transport_config(config, key).resolve_key())


def stream_host(config: ClusterConfig) -> str:
    """Where a worker's stream server binds: the transport's host, else the node's IP."""
    from transport.address import reachable_host

    return reachable_host(config.transport.host)


def make_sender(config: ClusterConfig, key: str | None):
    try:
        from transport.factory import make_sender as build
    except ImportError:
        from transport.receiver import ZmqSender as build
    return build(transport_config(config, key))


def _ray_node_id() -> str | None:
    """Ray's node id as the transport's node identity: shared memory only between replicas
    of one Ray node (several raylets on one machine, as in multi-node tests, use TCP)."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:  # noqa: BLE001 - outside Ray
        return None
