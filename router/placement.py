"""Where one request runs: replica choice and the routing policy, over a `ClusterView`.

`place()` picks the decode replica (prefix-cache affinity first, then load), the prefill
replica (shortest queue), asks the routing policy (router/policy.py), and may send a
local request whole to an idle prefill replica so that no hardware idles while the
decode replica is the busier one. It reads the view and changes nothing; the caller
records the request with `ClusterView.begin(placement)` when it sends it.

The request's `RequestWork` changes the counts: n sequences need n of the decode
replica's `max_num_seqs` and KV for n continuations (the prompt's full blocks shared), and
a request that wants prompt logprobs recomputes its whole prompt, so no replica's cached
prefix attracts it or shortens its prefill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.config import WorkloadProfile
from router.cluster_view import ClusterView, ReplicaInfo
from router.errors import unavailable
from router.policy import PLAIN, RequestWork, RouteContext, RouteDecision, decide
from workers.engine.kv_types import num_blocks
from workers.engine.prefix_hash import block_hashes

AFFINITY_MAX_IMBALANCE = 8  # affinity yields to load when the cached replica is this much busier


@dataclass
class Placement:
    """Where one request runs, and its in-flight state in the `ClusterView`."""

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
    num_sequences: int = 1  # streams it decodes on `target_replica` (n / best_of)


def place(view: ClusterView, prompt_ids: list[int], max_tokens: int, profile: WorkloadProfile,
          forced_mode: str | None, offload_to_prefill: bool = True, work: RequestWork = PLAIN) -> Placement:
    """Where the request runs; a 503 `APIError` when no replica can take it."""
    hashes = block_hashes(prompt_ids, view.block_size)
    # Hashes a replica's cache could serve: none when the prompt is recomputed whole. All
    # of `hashes` are still recorded where it goes: the engine registers its blocks.
    hits = [] if work.prompt_logprobs else hashes
    decodes, prefills = view.healthy("decode"), view.healthy("prefill")
    if not decodes and not prefills:  # every heartbeat overdue (a saturated CPU): not a dead pool
        decodes = view.overdue("decode")
    if not decodes and not prefills:
        raise unavailable("No healthy decode or prefill replica")
    prefill = min(prefills, key=view.load, default=None)
    if not decodes:  # only prefill replicas are left: they can run requests whole
        return _whole_on(view, prefill, hashes, hits, prompt_ids, RouteDecision("local", "decode-busy"), work)
    decode, hit_blocks = _choose_decode(view, decodes, hits)
    num_cached = min(hit_blocks * view.block_size, len(prompt_ids) - 1)
    ctx = RouteContext(
        prompt_len=len(prompt_ids), num_cached_tokens=num_cached, profile=profile,
        forced_mode=forced_mode, num_healthy_prefill=len(prefills),
        prefill_queue_len=view.load(prefill) if prefill else 0,
        decode_has_room=_has_room(view, decode, len(prompt_ids), max_tokens, hit_blocks, work.num_sequences),
        prefill_backlog_tokens=view.backlog[prefill.replica_id] if prefill else 0,
        decode_backlog_tokens=view.backlog[decode.replica_id], decode_num_streams=view.num_streams(decode),
        prefill_stats=dict(prefill.stats) if prefill else {}, decode_stats=dict(decode.stats), work=work)
    decision = decide(ctx)
    if decision.route == "disagg":
        prefill_hit = view.index.num_matched_blocks(prefill.replica_id, hits) * view.block_size
        return Placement("decode", decode.replica_id, prefill.replica_id, decision, num_cached, hashes,
                         prefill_on=prefill.replica_id, prefill_tokens=_uncached(prompt_ids, prefill_hit),
                         num_sequences=work.num_sequences)
    if offload_to_prefill and prefill is not None and _prefer_prefill(view, prefill, decode, hits, hit_blocks):
        return _whole_on(view, prefill, hashes, hits, prompt_ids, decision, work)
    return Placement("decode", decode.replica_id, None, decision, num_cached, hashes,
                     prefill_on=decode.replica_id, prefill_tokens=_uncached(prompt_ids, num_cached),
                     num_sequences=work.num_sequences)


def _choose_decode(view: ClusterView, decodes: list[ReplicaInfo], hashes: list[int]) -> tuple[ReplicaInfo, int]:
    least = min(decodes, key=view.load)
    hits = {r.replica_id: view.index.num_matched_blocks(r.replica_id, hashes) for r in decodes}
    best = max(decodes, key=lambda r: (hits[r.replica_id], -view.load(r)))
    if hits[best.replica_id] == 0 or view.load(best) - view.load(least) > AFFINITY_MAX_IMBALANCE:
        return least, hits[least.replica_id]
    return best, hits[best.replica_id]


def _has_room(view: ClusterView, replica: ReplicaInfo, prompt_len: int, max_tokens: int, hit_blocks: int,
              num_sequences: int) -> bool:
    """The replica has a sequence slot per stream (all of its `max_num_seqs` for a request
    of more, as the scheduler admits it) and KV blocks for every stream's continuation."""
    stats = replica.stats
    if view.load(replica) + min(num_sequences, view.max_num_seqs) > view.max_num_seqs:
        return False
    if "kv_blocks_free" not in stats:
        return True
    return int(stats["kv_blocks_free"]) >= _blocks_needed(view.block_size, prompt_len, max_tokens, hit_blocks,
                                                          num_sequences)


def _blocks_needed(block_size: int, prompt_len: int, max_tokens: int, hit_blocks: int, num_sequences: int) -> int:
    """Forked sequences share the prompt's full blocks; each holds its own copy of the
    partial last one and the blocks of its own continuation."""
    shared = prompt_len // block_size
    per_sequence = num_blocks(prompt_len + max_tokens, block_size) - shared
    return max(0, shared - hit_blocks) + num_sequences * per_sequence


def _prefer_prefill(view: ClusterView, prefill: ReplicaInfo, decode: ReplicaInfo, hashes: list[int],
                    decode_hit_blocks: int) -> bool:
    """An idle prefill replica takes a local request when the decode replica is busier
    and would not have saved more prompt work from its cache."""
    prefill_hit = view.index.num_matched_blocks(prefill.replica_id, hashes)
    return view.load(prefill) == 0 and view.load(decode) > 0 and prefill_hit >= decode_hit_blocks


def _whole_on(view: ClusterView, prefill: ReplicaInfo, hashes: list[int], hits: list[int], prompt_ids: list[int],
              decision: RouteDecision, work: RequestWork) -> Placement:
    hit = view.index.num_matched_blocks(prefill.replica_id, hits)
    num_cached = min(hit * view.block_size, len(prompt_ids) - 1)
    return Placement("prefill", prefill.replica_id, None, decision, num_cached, hashes,
                     prefill_on=prefill.replica_id, prefill_tokens=_uncached(prompt_ids, num_cached),
                     num_sequences=work.num_sequences)


def _uncached(prompt_ids: list[int], num_cached: int) -> int:
    return max(1, len(prompt_ids) - num_cached)
