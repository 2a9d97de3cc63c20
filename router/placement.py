"""Where one request runs: the router's view of the cluster, replica choice and policy.

`ClusterView` holds the replicas the ControlPlane reported plus what this router has in
flight on each (requests, and prompt tokens still waiting for their first token), and
the prefix index of what it routed where. `plan()` picks the decode
replica (prefix-cache affinity first, then load), the prefill replica (shortest queue),
asks the routing policy, and may send a local request whole to an idle prefill replica
so that no hardware idles while the decode replica is the busier one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from router.control_plane import ReplicaInfo
from router.errors import unavailable
from router.policy import ProfileView, RouteContext, RouteDecision, decide
from router.prefix_index import PrefixIndex
from workers.engine.prefix_hash import block_hashes

AFFINITY_MAX_IMBALANCE = 8  # affinity yields to load when the cached replica is this much busier


@dataclass
class RoutePlan:
    deployment: str  # "decode" | "prefill": whose `generate` runs the request
    target_replica: str | None
    prefill_replica: str | None  # for route == "disagg"
    decision: RouteDecision
    num_cached_tokens: int
    hashes: list[int] = field(default_factory=list, repr=False)
    prefill_released: bool = False  # the remote prefill finished: the prefill replica is free
    prefill_on: str | None = None  # the replica that computes the prompt
    prefill_tokens: int = 0  # the prompt tokens it computes (its expected cache hit aside)
    first_token: bool = False  # the first token is back: the prompt is done, it decodes now


class ClusterView:
    def __init__(self, block_size: int, max_num_seqs: int, prefix_capacity_blocks: int = 65536) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.replicas: dict[str, ReplicaInfo] = {}
        self.inflight: Counter[str] = Counter()
        self.backlog: Counter[str] = Counter()  # prompt tokens waiting for a first token
        self.awaiting_first: Counter[str] = Counter()  # target replica, before the first token
        self.excluded: set[str] = set()  # replicas that just failed a call, until the next update
        self.index = PrefixIndex(prefix_capacity_blocks)

    def update(self, replicas: list[ReplicaInfo]) -> None:
        self.replicas = {r.replica_id: r for r in replicas}
        self.excluded.clear()
        self.index.retain(self.replicas)

    def stream_address(self, replica_id: str | None) -> str | None:
        """The replica's advertised worker stream (workers/stream/client.py), if any."""
        replica = self.replicas.get(replica_id) if replica_id else None
        return replica.extra.get("stream_address") if replica is not None else None

    def healthy(self, role: str) -> list[ReplicaInfo]:
        return [r for r in self.replicas.values()
                if r.role == role and r.healthy and r.replica_id not in self.excluded]

    def overdue(self, role: str) -> list[ReplicaInfo]:
        """Replicas unhealthy only because their heartbeat is late (the last one said
        healthy). A dead one among them fails its call at once and is excluded (dispatch)."""
        return [r for r in self.replicas.values() if r.role == role and not r.healthy
                and r.stats.get("healthy", True) and r.replica_id not in self.excluded]

    def load(self, replica: ReplicaInfo) -> int:
        return max(replica.load, self.inflight[replica.replica_id])

    def begin(self, plan: RoutePlan) -> None:
        for replica_id in _touched(plan):
            self.inflight[replica_id] += 1
            self.index.insert(replica_id, plan.hashes)  # a prefill replica caches the prompt too
        if plan.prefill_on:
            self.backlog[plan.prefill_on] += plan.prefill_tokens
        if plan.target_replica:
            self.awaiting_first[plan.target_replica] += 1

    def end(self, plan: RoutePlan) -> None:
        self.first_token(plan)
        for replica_id in _touched(plan):
            _decrement(self.inflight, replica_id)

    def prefill_done(self, plan: RoutePlan) -> None:
        """The first token is back: a disaggregated request no longer loads its prefill
        replica (it decodes elsewhere), so `max_prefill_queue` counts prefills only."""
        self.first_token(plan)
        if plan.prefill_replica and not plan.prefill_released:
            plan.prefill_released = True
            _decrement(self.inflight, plan.prefill_replica)

    def first_token(self, plan: RoutePlan) -> None:
        """Idempotent: the prompt is computed; it no longer queues anyone's prefill."""
        if plan.first_token:
            return
        plan.first_token = True
        if plan.prefill_on:
            _decrement(self.backlog, plan.prefill_on, plan.prefill_tokens)
        if plan.target_replica:
            _decrement(self.awaiting_first, plan.target_replica)

    def num_streams(self, replica: ReplicaInfo) -> int:
        """Requests this router has past their first token on `replica`."""
        return max(0, self.inflight[replica.replica_id] - self.awaiting_first[replica.replica_id])

    def plan(self, prompt_ids: list[int], max_tokens: int, profile: ProfileView,
             forced_mode: str | None, offload_to_prefill: bool = True) -> RoutePlan:
        hashes = block_hashes(prompt_ids, self.block_size)
        decodes, prefills = self.healthy("decode"), self.healthy("prefill")
        if not decodes and not prefills:  # every heartbeat overdue (a saturated CPU): not a dead pool
            decodes = self.overdue("decode")
        if not decodes and not prefills:
            raise unavailable("No healthy decode or prefill replica")
        prefill = min(prefills, key=self.load, default=None)
        if not decodes:  # only prefill replicas are left: they can run requests whole
            return self._whole_on(prefill, hashes, prompt_ids, RouteDecision("local", "decode-busy"))
        decode, hit_blocks = self._choose_decode(decodes, hashes)
        num_cached = min(hit_blocks * self.block_size, len(prompt_ids) - 1)
        ctx = RouteContext(
            prompt_len=len(prompt_ids), num_cached_tokens=num_cached, profile=profile,
            forced_mode=forced_mode, num_healthy_prefill=len(prefills),
            prefill_queue_len=self.load(prefill) if prefill else 0,
            decode_has_room=self._has_room(decode, len(prompt_ids) + max_tokens, hit_blocks),
            prefill_backlog_tokens=self.backlog[prefill.replica_id] if prefill else 0,
            decode_backlog_tokens=self.backlog[decode.replica_id], decode_num_streams=self.num_streams(decode),
            prefill_stats=dict(prefill.stats) if prefill else {}, decode_stats=dict(decode.stats))
        decision = decide(ctx)
        if decision.route == "disagg":
            prefill_hit = self.index.num_matched_blocks(prefill.replica_id, hashes) * self.block_size
            return RoutePlan("decode", decode.replica_id, prefill.replica_id, decision, num_cached, hashes,
                             prefill_on=prefill.replica_id, prefill_tokens=_uncached(prompt_ids, prefill_hit))
        if offload_to_prefill and prefill is not None and self._prefer_prefill(prefill, decode, hashes, hit_blocks):
            return self._whole_on(prefill, hashes, prompt_ids, decision)
        return RoutePlan("decode", decode.replica_id, None, decision, num_cached, hashes,
                         prefill_on=decode.replica_id, prefill_tokens=_uncached(prompt_ids, num_cached))

    def _choose_decode(self, decodes: list[ReplicaInfo], hashes: list[int]) -> tuple[ReplicaInfo, int]:
        least = min(decodes, key=self.load)
        hits = {r.replica_id: self.index.num_matched_blocks(r.replica_id, hashes) for r in decodes}
        best = max(decodes, key=lambda r: (hits[r.replica_id], -self.load(r)))
        if hits[best.replica_id] == 0 or self.load(best) - self.load(least) > AFFINITY_MAX_IMBALANCE:
            return least, hits[least.replica_id]
        return best, hits[best.replica_id]

    def _has_room(self, replica: ReplicaInfo, num_tokens: int, hit_blocks: int) -> bool:
        stats = replica.stats
        if self.load(replica) >= self.max_num_seqs:
            return False
        if "kv_blocks_free" not in stats:
            return True
        blocks_needed = -(-num_tokens // self.block_size) - hit_blocks
        return int(stats["kv_blocks_free"]) >= blocks_needed

    def _prefer_prefill(self, prefill: ReplicaInfo, decode: ReplicaInfo, hashes: list[int],
                        decode_hit_blocks: int) -> bool:
        """An idle prefill replica takes a local request when the decode replica is busier
        and would not have saved more prompt work from its cache."""
        prefill_hit = self.index.num_matched_blocks(prefill.replica_id, hashes)
        return self.load(prefill) == 0 and self.load(decode) > 0 and prefill_hit >= decode_hit_blocks

    def _whole_on(self, prefill: ReplicaInfo, hashes: list[int], prompt_ids: list[int],
                  decision: RouteDecision) -> RoutePlan:
        hit = self.index.num_matched_blocks(prefill.replica_id, hashes)
        num_cached = min(hit * self.block_size, len(prompt_ids) - 1)
        return RoutePlan("prefill", prefill.replica_id, None, decision, num_cached, hashes,
                         prefill_on=prefill.replica_id, prefill_tokens=_uncached(prompt_ids, num_cached))


def _touched(plan: RoutePlan) -> list[str]:
    prefill = None if plan.prefill_released else plan.prefill_replica
    return [r for r in (plan.target_replica, prefill) if r]


def _uncached(prompt_ids: list[int], num_cached: int) -> int:
    return max(1, len(prompt_ids) - num_cached)


def _decrement(counter: Counter[str], key: str, amount: int = 1) -> None:
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]
