"""Where one request runs: replica choice and the routing policy, over a `ClusterView`.

`place()` picks the decode replica (prefix-cache affinity first, then load), the prefill
replica (shortest queue), asks the routing policy (router/policy.py), and may send a
local request whole to the prefill replica, so that no hardware idles while the decode
replica is the busier one: `auto` prices that beside the requests already run whole
there, while the prefill replica computes no remote prefill (it then decodes too, as long as
that serves the SLOs best); the fixed rules take it only while it is idle. It reads the
view and changes nothing; the caller records the request with
`ClusterView.begin(placement)` when it sends it.

The request's `RequestWork` changes the counts: n sequences need n of the decode
replica's `max_num_seqs` and KV for n continuations (the prompt's full blocks shared), and
a request that wants prompt logprobs recomputes its whole prompt, so no replica's cached
prefix attracts it or shortens its prefill.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from cluster.config import SLO, WorkloadProfile
from router import predict
from router.auto_policy import corrected
from router.cluster_view import ClusterView, ReplicaInfo
from router.corrections import EMPTY, LearnedState
from router.errors import unavailable
from router.policy import PLAIN, RequestWork, RouteContext, RouteDecision
from router.prefix_index import block_keys
from router.routing import PolicySettings, decide
from workers.engine.cost_model import prefill_work
from workers.engine.kv_types import num_blocks

AFFINITY_MAX_IMBALANCE = 8  # affinity yields to load when the cached replica is this much busier
MAX_PREFILL_CANDIDATES = 4  # remote candidates priced per request: the least-loaded prefill replicas


@dataclass(frozen=True)
class PolicyInputs:
    """What the routing policy reads beyond the request and the view: the request's id
    (exploration), its objectives, this router's learned corrections and the clock."""

    request_id: str = ""
    slo: SLO = field(default_factory=SLO)
    state: LearnedState = EMPTY
    now: float = 0.0
    settings: PolicySettings = field(default_factory=PolicySettings)


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
    prefill_work: int = 0  # the attention work of those prompt tokens (router/predict.py)
    tpot_slo_s: float | None = None  # its workload's TPOT objective (the streams' objective there)
    ttft_slo_s: float | None = None  # its workload's TTFT objective
    ended: bool = False  # `ClusterView.end` ran: its streams no longer count on `target_replica`
    prompt_len: int = 0  # its context when it starts decoding
    placed_at: float = 0.0  # the policy's clock (`PolicyInputs.now`) when it was placed
    max_tokens: int = 0  # tokens each of its sequences may generate
    first_token_at: float | None = None  # the policy's clock at its first token (None: not told)
    tokens_back: int = 0  # tokens its sequences have streamed back, all sequences together
    context: RouteContext | None = field(default=None, repr=False)  # what the policy read (the decision log)
    request_id: str = ""  # the id its replicas know it by (before the engine's counter)
    measured_ttft_s: float | None = None  # router-side, once it finished (the decision log)
    measured_tpot_s: float | None = None  # its mean gap after the first token (two tokens or more)
    worker_ttft_s: float | None = None  # the called worker's own TTFT, where it said (`GenerateChunk`)
    transfer_tail_s: float | None = None  # disagg: its KV transfer's tail, where the stream said it

    def tpot_allowance(self, now: float | None) -> float | None:
        """The mean gap its streams can still take over the tokens they have left and
        meet the TPOT objective (what they spent since the first token is gone from it);
        the objective itself before the first token, without a clock or without a known
        length; None once the objective is out of reach (nothing left to protect)."""
        if self.tpot_slo_s is None or self.first_token_at is None or now is None or self.max_tokens < 2:
            return self.tpot_slo_s
        done = self.tokens_back / max(1, self.num_sequences)
        left = self.max_tokens - done
        if left <= 0:
            return self.tpot_slo_s
        budget = self.tpot_slo_s * (self.max_tokens - 1) - (now - self.first_token_at)
        return budget / left if budget > 0 else None


def place(view: ClusterView, prompt_ids: list[int], max_tokens: int, profile: WorkloadProfile,
          forced_mode: str | None, offload_to_prefill: bool = True, work: RequestWork = PLAIN,
          inputs: PolicyInputs = PolicyInputs(), keep_context: bool = False) -> Placement:
    """Where the request runs; a 503 `APIError` when no replica can take it. With
    `keep_context`, the placement keeps what the policy read (for the decision log; a
    simulator of many requests leaves it off)."""
    placement, ctx = _place(view, prompt_ids, max_tokens, profile, forced_mode, offload_to_prefill, work, inputs)
    placement.max_tokens = max_tokens
    if keep_context:
        placement.context = ctx
    return placement


def _place(view: ClusterView, prompt_ids: list[int], max_tokens: int, profile: WorkloadProfile,
           forced_mode: str | None, offload_to_prefill: bool, work: RequestWork,
           inputs: PolicyInputs) -> tuple[Placement, RouteContext | None]:
    hashes = block_keys(prompt_ids, view.block_size)
    # Hashes a replica's cache could serve: none when the prompt is recomputed whole. All
    # of `hashes` are still recorded where it goes: the engine registers its blocks.
    hits = [] if work.prompt_logprobs else hashes
    decodes, prefills = view.healthy("decode"), view.healthy("prefill")
    if not decodes and not prefills:  # every heartbeat overdue (a saturated CPU): not a dead pool
        decodes = view.overdue("decode")
    if not decodes and not prefills:
        raise unavailable("No healthy decode or prefill replica")
    ranked = least_loaded(view, prefills, MAX_PREFILL_CANDIDATES)
    prefill = ranked[0] if ranked else None
    if not decodes:  # only prefill replicas are left: they can run requests whole
        decision = _whole_decision(view, prefill, prompt_ids, hits, max_tokens, profile, work, inputs)
        return _whole_on(view, prefill, hashes, hits, prompt_ids, decision, work, inputs), None
    decode, hit_blocks = _choose_decode(view, decodes, hits)
    num_cached = min(hit_blocks * view.block_size, len(prompt_ids) - 1)
    priced = (forced_mode or profile.mode) == "auto"
    whole = prefill if offload_to_prefill and prefill is not None and _offers_whole(
        view, prefill, decode, hits, hit_blocks, priced, len(prompt_ids), max_tokens, work) else None
    ctx = RouteContext(
        prompt_len=len(prompt_ids), num_cached_tokens=num_cached, profile=profile,
        forced_mode=forced_mode, num_healthy_prefill=len(prefills),
        prefill_queue_len=view.load(prefill) if prefill else 0,
        decode_has_room=_has_room(view, decode, len(prompt_ids), max_tokens, hit_blocks, work.num_sequences),
        prefill_backlog_tokens=view.backlog[prefill.replica_id] if prefill else 0,
        decode_backlog_tokens=view.backlog[decode.replica_id], decode_num_streams=view.num_streams(decode),
        work=work, request_id=inputs.request_id, max_tokens=max_tokens, slo=inputs.slo,
        decode=view.load_of(decode, inputs.now, arrival_objectives=True), prefills=tuple(view.load_of(p, inputs.now) for p in ranked),
        prefill_cached_tokens=tuple(_cached(view, p, hits, prompt_ids) for p in ranked),
        whole=view.load_of(whole, inputs.now, recent_prompts=True) if whole else None,
        whole_cached_tokens=_cached(view, whole, hits, prompt_ids) if whole else 0)
    decision = decide(ctx, inputs.state, inputs.now, inputs.settings)
    kind = decision.candidate.kind if decision.candidate is not None else None
    if decision.route == "disagg":
        chosen = decision.candidate.prefill_replica if decision.candidate is not None else prefill.replica_id
        prefill_hit = _cached(view, view.replicas[chosen], hits, prompt_ids)
        return _placed(view, "decode", decode.replica_id, chosen, decision, num_cached, hashes, prompt_ids,
                       prefill_hit, chosen, work, inputs), ctx
    if kind == "whole" and whole is not None:
        return _whole_on(view, whole, hashes, hits, prompt_ids, decision, work, inputs), ctx
    return _placed(view, "decode", decode.replica_id, None, decision, num_cached, hashes, prompt_ids, num_cached,
                   decode.replica_id, work, inputs), ctx


def _whole_decision(view: ClusterView, prefill: ReplicaInfo, prompt_ids: list[int], hits: list[int],
                    max_tokens: int, profile: WorkloadProfile, work: RequestWork,
                    inputs: PolicyInputs) -> RouteDecision:
    """No decode replica: the request runs whole on `prefill`, priced like any candidate."""
    cached = _cached(view, prefill, hits, prompt_ids)
    shape = RouteContext(len(prompt_ids), cached, profile, max_tokens=max_tokens, work=work).shape
    candidate = predict.whole(shape, view.load_of(prefill, inputs.now), cached)
    return RouteDecision("local", "decode-busy", candidate=candidate,
                         prediction=corrected(candidate, inputs.state, inputs.now))


def _placed(view: ClusterView, deployment: str, target: str, prefill_replica: str | None, decision: RouteDecision,
            num_cached: int, hashes: list[int], prompt_ids: list[int], computed_from: int, prefill_on: str,
            work: RequestWork, inputs: PolicyInputs) -> Placement:
    """A Placement whose prompt is computed on `prefill_on` from its cached `computed_from` tokens."""
    start = 0 if work.prompt_logprobs else min(computed_from, len(prompt_ids) - 1)
    chunk = view.chunk_tokens(prefill_on)
    return Placement(deployment, target, prefill_replica, decision, num_cached, hashes, prefill_on=prefill_on,
                     prefill_tokens=_uncached(prompt_ids, computed_from),
                     num_sequences=work.num_sequences, prefill_work=prefill_work(start, len(prompt_ids), chunk)[2],
                     tpot_slo_s=inputs.slo.tpot_ms / 1000.0, ttft_slo_s=inputs.slo.ttft_ms / 1000.0,
                     prompt_len=len(prompt_ids), placed_at=inputs.now, request_id=inputs.request_id)


def _cached(view: ClusterView, replica: ReplicaInfo, hits: list[int], prompt_ids: list[int]) -> int:
    """The replica's expected prefix-cache hit for this prompt, in tokens."""
    return min(view.index.num_matched_blocks(replica.replica_id, hits) * view.block_size, len(prompt_ids) - 1)


def _choose_decode(view: ClusterView, decodes: list[ReplicaInfo], hashes: list[int]) -> tuple[ReplicaInfo, int]:
    """The replica with the longest cached prefix (the least loaded of those), unless it is
    much busier than the least loaded one; and its hit in blocks. One pass over the pool
    (this runs per request): the first of the least loaded, and the first of those with
    the longest hit."""
    index, inflight, held_by = view.index, view.inflight, view.index.held_blocks
    num_hashes = len(hashes)
    least = best = decodes[0]
    least_load = best_load = view.load(least)
    best_hit = index.num_matched_blocks(least.replica_id, hashes)
    for r in decodes[1:]:  # `view.load` and `index.holds` inlined: this loop is the router's hot path
        rid = r.replica_id
        load = r.load
        queued = inflight.get(rid, 0)
        if queued > load:
            load = queued
        if load < least_load:
            least, least_load = r, load
        # A longer run than the best's holds block `best_hit`; without it, r wins only a
        # tie at less load. So a replica as busy that lacks that block is not scanned.
        if load >= best_load:
            if best_hit >= num_hashes:
                continue
            held = held_by.get(rid)
            if held is None or hashes[best_hit] not in held:
                continue
        hit = index.num_matched_blocks(rid, hashes)
        if hit > best_hit or (hit == best_hit and load < best_load):
            best, best_load, best_hit = r, load, hit
    if best_hit == 0 or best_load - least_load > AFFINITY_MAX_IMBALANCE:
        return least, best_hit if least is best else index.num_matched_blocks(least.replica_id, hashes)
    return best, best_hit


def least_loaded(view: ClusterView, replicas: list[ReplicaInfo], k: int) -> list[ReplicaInfo]:
    """The `k` of `replicas` with the least `view.load`, in that order (ties: in their order)."""
    inflight = view.inflight  # `load` inlined: this runs over the prefill pool per request
    keyed = []
    for i, r in enumerate(replicas):
        reported, queued = r.load, inflight.get(r.replica_id, 0)
        keyed.append((reported if reported > queued else queued, i, r))
    return [r for _, _, r in heapq.nsmallest(k, keyed)]


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


def _offers_whole(view: ClusterView, prefill: ReplicaInfo, decode: ReplicaInfo, hashes: list[int],
                  decode_hit_blocks: int, priced: bool, prompt_len: int, max_tokens: int, work: RequestWork) -> bool:
    """The prefill replica may run a local request whole where the decode replica would
    not have saved more prompt work from its cache: under `auto` (`priced`), which weighs
    it beside the requests already run whole there, while it computes no remote prefill
    and has room for it; under the fixed rules only while it is idle and the decode
    replica is not.

    Not beside a remote prefill: there the request queues behind a prompt whose chunks
    then stall it, and the remote prefills queue behind it in turn, which the
    predictions caught badly. Against the idle-only offer, over 18 simulated `bench
    cluster` mixed traces (792 requests a cell), offering it whatever the replica
    computed gained 50 good requests in the tight-TTFT cell but lost 11 in the balanced
    and 10 in the tight-TPOT one. Beside prompts that are themselves run whole there
    (a short prompt 30 ms behind another, which took the idle replica first, was left
    to queue behind a long prompt on the decode replica and missed a tight TTFT), over
    120 simulated mixed traces under four runs' calibrations (5,280 requests a cell),
    offering it there too gained 75 in tight-TTFT, 25 in balanced, 24 in tight-TPOT, 6
    in tight and 1 in loose."""
    hit = view.index.num_matched_blocks(prefill.replica_id, hashes)
    if hit < decode_hit_blocks:
        return False
    if priced:
        return _computes_no_remote_prefill(view, prefill) and _has_room(view, prefill, prompt_len, max_tokens, hit,
                                                                          work.num_sequences)
    return view.load(prefill) == 0 and view.load(decode) > 0


def _computes_no_remote_prefill(view: ClusterView, replica: ReplicaInfo) -> bool:
    """No remote prefill this router sent there waits for its first token, and its last
    heartbeat had no more prompt tokens waiting than this router's own requests run
    whole there (another router's could be remote prefills)."""
    rid = replica.replica_id
    if any(not p.first_token for p in view.waiting.get(("disagg", rid), ())):
        return False
    return view.heartbeat_load(replica).queue_tokens <= view.backlog.get(rid, 0)


def _whole_on(view: ClusterView, prefill: ReplicaInfo, hashes: list[int], hits: list[int], prompt_ids: list[int],
              decision: RouteDecision, work: RequestWork, inputs: PolicyInputs) -> Placement:
    num_cached = _cached(view, prefill, hits, prompt_ids)
    return _placed(view, "prefill", prefill.replica_id, None, decision, num_cached, hashes, prompt_ids, num_cached,
                   prefill.replica_id, work, inputs)


def _uncached(prompt_ids: list[int], num_cached: int) -> int:
    return max(1, len(prompt_ids) - num_cached)
