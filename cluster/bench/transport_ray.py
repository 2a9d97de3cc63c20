"""The Ray object store baseline of `pdcluster bench transport`: `ray.put` in one actor,
`ray.get` plus one copy into a warm destination in another, timed inside the actors (the
actor-call overhead excluded), on one raylet or across two."""

from __future__ import annotations

import time

# Ray's store places the next object in fresh shared memory while the last one is still
# being released, so its first rounds page-fault: 115, 43, 93, 39, then 22-24 ms at 64 MiB
# were measured. The baseline is its steady state, as our paths' is (warm buffers).
RAY_WARMUP = 4


def time_ray(sizes: list[int], repeats: int, cross_node: bool) -> dict[int, list[float]]:
    """`ray.put` in one actor, `ray.get` + one copy into a warm destination in another.

    Same node, Ray's object store is shared memory (the peer of our `shm` path); across
    nodes the object manager pulls the object over TCP (the peer of `zmq`). `cross_node`
    runs two raylets on this machine (`ray.cluster_utils.Cluster`, as the multi-node
    tests do) with the actors on different ones, so the bytes cross loopback TCP."""
    import ray

    cluster = None
    store = max(sizes) * 4 + (256 << 20)
    if cross_node:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 1, "resources": {"bench_put": 1}, "object_store_memory": store})
        cluster.add_node(num_cpus=1, resources={"bench_get": 1}, object_store_memory=store)
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 object_store_memory=store)
    try:
        return _ray_rounds(sizes, repeats, cross_node)
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def _ray_rounds(sizes: list[int], repeats: int, cross_node: bool) -> dict[int, list[float]]:
    import numpy as np
    import ray

    put_on = {"resources": {"bench_put": 0.1}} if cross_node else {}
    get_on = {"resources": {"bench_get": 0.1}} if cross_node else {}

    @ray.remote(num_cpus=0, **put_on)
    class Putter:
        def put(self, nbytes: int):
            data = np.random.randint(0, 255, nbytes, dtype=np.uint8)
            t0 = time.perf_counter()
            ref = ray.put(data)
            return [ref], time.perf_counter() - t0

    @ray.remote(num_cpus=0, **get_on)
    class Getter:
        def __init__(self) -> None:
            self._dst: dict[int, np.ndarray] = {}  # warm, like a receiver's KV blocks

        def get(self, refs):
            t0 = time.perf_counter()
            data = ray.get(refs[0])
            dst = self._dst.setdefault(data.nbytes, np.empty_like(data))
            np.copyto(dst, data)  # into the destination, as a receiver writes KV blocks
            return time.perf_counter() - t0

    putter, getter = Putter.remote(), Getter.remote()
    out = {}
    for nbytes in sizes:
        times = []
        for i in range(repeats + RAY_WARMUP):
            refs, t_put = ray.get(putter.put.remote(nbytes))
            t_get = ray.get(getter.get.remote(refs))
            del refs
            if i >= RAY_WARMUP:
                times.append(t_put + t_get)
        out[nbytes] = times
    return out
