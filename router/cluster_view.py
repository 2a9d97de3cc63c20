"""The router's view of the cluster: the replicas the ControlPlane reported, plus what
this router has sent them since.

Heartbeats arrive about every half second (`update`); between them the router counts
its own sequences on each replica (`begin` ... `end`; a request of n sequences counts n
where it decodes and one where it is only prefilled, as the engines count `num_running`
after the fork), the prompt tokens still waiting
for their first token there (its prefill backlog), and which prompt blocks it sent
where (`PrefixIndex`). Where a request goes is decided from this view by
`router/placement.py`; nothing here does I/O, so a simulator can drive it directly.

`load_of` combines the two for the predictions (router/replica_load.py): a replica's
queue is what its last heartbeat reported plus the prompts this router sent it since,
less those that got their first token since, and never less than this router's own
backlog there (less what the heartbeat says is computed of the prompts it names,
`ReplicaLoad.prefill_progress`); so routers that share replicas see each other's work
within a heartbeat.
A heartbeat is a heartbeat period old, or more, when a request is placed: the replica
has computed part of its queue since, and `load_of(replica, now)` takes that off, at the
pace the queue drains, for at most `MAX_HEARTBEAT_AGE_S` (`heartbeat_age`); and a prompt
this router places on a replica with nothing left to compute starts at once, so the
prompts it sends there drain from that moment on (router/replica_queue.py).
A request still prefilling on another replica already counts as a stream where it will
decode once its predicted first token is near (router/incoming.py). And a request still
waiting for its first token past its predicted TTFT is evidence before it finishes:
`load_of(replica, now)` reports, per route, how far past it the oldest one prefilling
there is (`ReplicaLoad.overdue`, router/overdue.py), so
a path that stalls (a slowed link, a stuck replica) is priced as slow while its first
victims are still waiting, not only once they complete.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from typing import TYPE_CHECKING

from router.arrival_rate import ArrivalRate
from router.heartbeat_parses import HeartbeatParses
from router.incoming import due_later, due_soon
from router.overdue import overdue
from router.prefix_index import PrefixIndex
from router.prompt_tally import Since, pending
from router.replica_info import ReplicaInfo
from router.replica_load import DEFAULT_CHUNK_TOKENS, ReplicaLoad
from router.replica_queue import MAX_HEARTBEAT_AGE_S, QueueDrains, computed, queue_of, wake

if TYPE_CHECKING:
    from router.placement import Placement


class ClusterView:
    """The replicas from the last heartbeats, plus this router's requests on each since."""

    def __init__(self, block_size: int, max_num_seqs: int, prefix_capacity_blocks: int = 65536) -> None:
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.replicas: dict[str, ReplicaInfo] = {}
        self.inflight: Counter[str] = Counter()
        self.backlog: Counter[str] = Counter()  # prompt tokens waiting for a first token
        self.awaiting_first: Counter[str] = Counter()  # target replica, before the first token
        # prefill replica: the remote prefills it computes for another replica, until done (not streams)
        self.prefilling: Counter[str] = Counter()
        # target replica -> the requests prefilling elsewhere that will decode there
        self.incoming: dict[str, dict[int, Placement]] = {}
        # (route, replica that prefills): placements waiting for their first token, oldest first
        self.waiting: dict[tuple[str, str], deque[Placement]] = {}
        self.excluded: set[str] = set()  # replicas that just failed a call, until the next update
        # of `backlog`, this router's background prefills (they drain beside the foreground ones)
        self.background_backlog: Counter[str] = Counter()
        self.background_backlog_work: Counter[str] = Counter()
        self._healthy: dict[tuple[str, int], tuple[dict, list[ReplicaInfo]]] = {}
        self.index = PrefixIndex(prefix_capacity_blocks)
        self.backlog_work: Counter[str] = Counter()  # their attention work (router/predict.py)
        self.taken_at: dict[str, float] = {}  # per replica: when its last heartbeat was taken (policy clock)
        self.since: dict[str, Since] = {}  # per replica: this router's prompts since its last heartbeat
        # per replica: this router's requests that decode there under a TPOT objective
        self.slo_streams: dict[str, dict[int, Placement]] = {}
        self.heartbeats = HeartbeatParses()  # per replica: its last heartbeat, parsed as the poll brought it
        self.drains = QueueDrains()  # what a heartbeat's queue, and what was sent since, take to drain
        self.nodes: dict[str, list[ReplicaInfo]] = {}  # node id -> its healthy replicas (known ids only)
        # per replica: the requests this router placed to decode there lately, each with its TTFT objective
        self.arrivals = ArrivalRate()
        # per replica: the prompt tokens (and their attention work) it placed to be computed there lately
        self.prompts = ArrivalRate(num_weights=2)

    def update(self, replicas: list[ReplicaInfo], now: float | None = None, read_at: float | None = None) -> None:
        """The replicas as the registry holds them; with `now` (the policy's clock) and
        `read_at` (the registry's clock, which stamped `last_heartbeat`, when it was read)
        also how old each heartbeat is (`heartbeat_age`)."""
        old = self.replicas
        self.replicas = {r.replica_id: r for r in replicas}
        for r in replicas:
            if r.replica_id not in old or old[r.replica_id].last_heartbeat != r.last_heartbeat:
                self.since[r.replica_id] = Since()  # the new heartbeat counts what came before
        self.taken_at = ({r.replica_id: now - max(0.0, read_at - r.last_heartbeat) for r in replicas}
                         if now is not None and read_at is not None else {})
        for gone in set(self.since) - set(self.replicas):
            del self.since[gone]
        for key in [k for k in self.waiting if k[1] not in self.replicas]:
            del self.waiting[key]
        self.excluded.clear()
        self.index.retain(self.replicas)
        for r in replicas:
            self.index.set_capacity(r.replica_id, r.kv_pool_blocks)
        for rate in (self.arrivals, self.prompts):
            rate.forget(set(self.replicas))
        self.heartbeats.take_in(self.replicas.values())
        for role in ("decode", "prefill"):  # built here, not by the first decision after the heartbeat
            self.healthy(role)
        self.drains.clear()
        self.nodes = {}
        for r in replicas:
            if r.node_id and r.healthy:
                self.nodes.setdefault(r.node_id, []).append(r)

    def load_of(self, replica: ReplicaInfo, now: float | None = None, recent_prompts: bool = False,
                arrival_objectives: bool = False) -> ReplicaLoad:
        """The replica's step model and queue, its heartbeat combined with this router's
        requests; with `now` (the policy's clock) also how overdue its prefills are and,
        with `recent_prompts`, each prompt placed there lately (only a request run whole
        on the replica reads them: `burst_risk.burst_miss_chance`), with
        `arrival_objectives` the TTFT objective of each request placed to decode there
        lately and when each request still prefilling elsewhere to decode there is due
        (only the local candidates read them)."""
        rid = replica.replica_id
        base = self.heartbeat_load(replica)
        since = self.since.get(rid) or Since()
        decoding = max(base.num_streams, self.num_streams(replica))
        per_stream = base.stream_context / base.num_streams if base.num_streams else 0.0
        incoming, incoming_context = self.incoming_soon(rid, now)
        context = base.stream_context + (decoding - base.num_streams) * per_stream + incoming_context
        allowances = self.stream_allowances(rid, now)
        queued = self.queued_here(rid)
        node_busy = float(self.node_busy(replica)) if base.coefficients.node_contention > 0 else 0.0
        prompt_tokens, prompt_work = self.prompts.rates(rid, now) if now is not None else (0.0, 0.0)
        done = computed(self, rid, base.prefill_progress)
        queue_tokens, queue_work, ran = queue_of(self, rid, base, since, done, node_busy, now)
        return base.evolve(
            coefficients=self.heartbeats.slowed(rid, base, node_busy),
            queue_tokens=queue_tokens, queue_work=queue_work,
            background_tokens=min(queue_tokens, pending(
                base.background_tokens, self.background_backlog.get(rid, 0) - done.background.tokens,
                ran * base.background_tokens)),
            background_work=min(queue_work, pending(
                base.background_work, self.background_backlog_work.get(rid, 0) - done.background.work,
                ran * base.background_work)),
            background_chunk_tokens=base.background_chunk_tokens or self._background_chunk(rid),
            num_streams=decoding + incoming, stream_context=int(context),
            stream_tokens_left=self.tokens_left(rid, base, decoding - base.num_streams + incoming),
            num_requests=self.load(replica), stream_allowances=allowances,
            queued_streams=queued[0], queued_context=queued[1],
            queued_tokens_left=queued[2] / queued[0] if queued[0] else 0.0,
            overdue=self.overdue_of(rid, now) if now is not None else {},
            arrival_rate=self.arrivals.rate(rid, now) if now is not None else 0.0,
            prompt_token_rate=prompt_tokens, prompt_work_rate=prompt_work,
            prompt_rate=self.prompts.count_rate(rid, now) if now is not None else 0.0,
            recent_prompts=self.prompts.recent(rid, now) if now is not None and recent_prompts else (),
            arrival_ttft_objectives=self.arrivals.tag_counts(rid, now) if now is not None and arrival_objectives else (),
            incoming_due_s=due_later(self.incoming.get(rid, {}).values(), now)
            if now is not None and arrival_objectives else (),
            node_id=replica.node_id, node_busy=node_busy)

    def tokens_left(self, replica_id: str, base: ReplicaLoad, unreported: int) -> float:
        """The tokens each stream on the replica still has to generate, on average: its
        heartbeat's figure for the streams it counted and, for the `unreported` ones (this
        router's that started since, and those due from other replicas), what this
        router's own requests decoding there have left. The heartbeat's alone, on a replica
        whose last heartbeat had no stream yet, priced every stream there as one token from
        its end, so a short prompt's single prefill step stretched their whole remaining
        life: streams 30 tokens from theirs looked 70-98 ms a token beside a local prefill
        of 70-117 tokens, against 28-31 remote (bench cluster, tight-TPOT cell)."""
        own = self.slo_streams.get(replica_id)
        if unreported <= 0 or not own:
            return base.stream_tokens_left
        left = [p.max_tokens - p.tokens_back / max(1, p.num_sequences) for p in own.values()
                if p.first_token or p.prefill_on != replica_id]  # not the prompts queued there: not streams yet
        if not left:
            return base.stream_tokens_left
        own_left = max(1.0, sum(left) / len(left))
        return (base.num_streams * base.stream_tokens_left + unreported * own_left) / (base.num_streams + unreported)

    def heartbeat_age(self, replica_id: str, now: float | None) -> float:
        """Seconds since the replica's last heartbeat was taken (0 when unknown), at most
        `MAX_HEARTBEAT_AGE_S`: a queue is taken to drain no longer than that unseen (one
        that stalls shows as overdue prefills, `overdue_of`)."""
        taken_at = self.taken_at.get(replica_id) if now is not None else None
        return 0.0 if taken_at is None else min(max(0.0, now - taken_at), MAX_HEARTBEAT_AGE_S)

    def stream_allowances(self, replica_id: str, now: float | None) -> tuple[float, ...]:
        """Ascending: the mean gap each of this router's streams on `replica_id` with a TPOT
        objective can still afford (`Placement.tpot_allowance`), 0 for one already past
        reach; () when it has none there."""
        placements = self.slo_streams.get(replica_id)
        if not placements:
            return ()
        return tuple(sorted(p.tpot_allowance(now) or 0.0 for p in placements.values() if p.tpot_slo_s is not None))

    def queued_here(self, replica_id: str) -> tuple[int, int, int]:
        """(sequences, their prompt tokens, tokens they will generate) of this router's
        requests queued to prefill in the foreground on `replica_id` and decode there: they
        become streams before a prompt queued behind them gets its chunks."""
        seqs = context = tokens = 0
        for p in self.waiting.get(("local", replica_id), ()):
            if p.first_token or p.decision.yield_prefill or p.target_replica != replica_id:
                continue
            seqs += p.num_sequences
            context += p.num_sequences * p.prompt_len
            tokens += p.num_sequences * p.max_tokens
        return seqs, context, tokens

    def node_busy(self, replica: ReplicaInfo) -> int:
        """The other replicas of `replica`'s node with work now (as this view counts it)."""
        inflight, backlog, me = self.inflight, self.backlog, replica.replica_id  # `load` inlined: per candidate
        busy = 0
        for r in self.nodes.get(replica.node_id, ()):  # a loop, not sum() over a generator: a third faster
            rid = r.replica_id
            if rid != me and (r.load > 0 or inflight.get(rid, 0) > 0 or backlog.get(rid, 0) > 0):
                busy += 1
        return busy

    def incoming_soon(self, replica_id: str, now: float | None = None) -> tuple[int, int]:
        """(sequences, their context tokens) prefilling elsewhere that will decode on
        `replica_id`: with `now`, only those due soon (`router/incoming.py`)."""
        return due_soon(self.incoming.get(replica_id, {}).values(), now)

    def overdue_of(self, replica_id: str, now: float) -> dict[str, float]:
        """Per route, how late the oldest prefill waiting on `replica_id` is (router/overdue.py)."""
        return overdue(self.waiting, replica_id, now)

    def chunk_tokens(self, replica_id: str) -> int:
        """The replica's token budget per engine step (the default before it reported one)."""
        replica = self.replicas.get(replica_id)
        return self.heartbeat_load(replica).chunk_tokens if replica is not None else DEFAULT_CHUNK_TOKENS

    def heartbeat_load(self, replica: ReplicaInfo) -> ReplicaLoad:
        """The replica's last heartbeat as it reported it, nothing of this router's since
        (parsed when `update` took it in: router/heartbeat_parses.py)."""
        return self.heartbeats.load(replica)

    def stream_address(self, replica_id: str | None) -> str | None:
        """The replica's advertised worker stream (workers/stream/client.py), if any."""
        replica = self.replicas.get(replica_id) if replica_id else None
        return replica.extra.get("stream_address") if replica is not None else None

    def healthy(self, role: str) -> list[ReplicaInfo]:
        """The role's healthy replicas not excluded; kept until the next `update` or
        exclusion (placement asks per request)."""
        key = (role, len(self.excluded))
        cached = self._healthy.get(key)
        if cached is None or cached[0] is not self.replicas:
            cached = (self.replicas, [r for r in self.replicas.values()
                                      if r.role == role and r.healthy and r.replica_id not in self.excluded])
            self._healthy[key] = cached
        return cached[1]

    def overdue(self, role: str) -> list[ReplicaInfo]:
        """Replicas unhealthy only because their heartbeat is late (the last one said
        healthy). A dead one among them fails its call at once and is excluded (dispatch)."""
        return [r for r in self.replicas.values() if r.role == role and not r.healthy
                and r.stats.get("healthy", True) and r.replica_id not in self.excluded]

    def load(self, replica: ReplicaInfo) -> int:
        # `get`, not `[]`: a Counter's missing key costs a Python call, and this runs per
        # replica per request
        return max(replica.load, self.inflight.get(replica.replica_id, 0))

    def num_streams(self, replica: ReplicaInfo) -> int:
        """Sequences this router has past their first token on `replica`."""
        rid = replica.replica_id
        return max(0, self.inflight.get(rid, 0) - self.awaiting_first.get(rid, 0) - self.prefilling.get(rid, 0))

    # In-flight bookkeeping of one placed request: begin, first_token/prefill_done, end.
    def begin(self, placement: Placement) -> None:
        for replica_id, num_seqs in _touched(placement):
            self.inflight[replica_id] += num_seqs
            self.index.insert(replica_id, placement.hashes)  # a prefill replica caches the prompt too
        if _remote_prefill_on(placement):
            self.prefilling[placement.prefill_replica] += 1
        if placement.prefill_on and placement.decision.prediction is not None:
            key = (placement.decision.route, placement.prefill_on)
            self.waiting.setdefault(key, deque()).append(placement)
        if placement.prefill_on:
            wake(self, placement.prefill_on, placement.placed_at, placement.decision.yield_prefill)
            self.backlog[placement.prefill_on] += placement.prefill_tokens
            self.backlog_work[placement.prefill_on] += placement.prefill_work
            self.since_of(placement.prefill_on).sent.add(placement.prefill_tokens, placement.prefill_work)
            self.prompts.add(placement.prefill_on, placement.placed_at, placement.prefill_tokens,
                             placement.prefill_work)
            if placement.decision.yield_prefill:
                self.background_backlog[placement.prefill_on] += placement.prefill_tokens
                self.background_backlog_work[placement.prefill_on] += placement.prefill_work
        if placement.target_replica:
            self.arrivals.add(placement.target_replica, placement.placed_at,
                              tag=placement.ttft_slo_s or math.inf)
            self.awaiting_first[placement.target_replica] += placement.num_sequences
            if _prefills_elsewhere(placement):
                self.incoming.setdefault(placement.target_replica, {})[id(placement)] = placement
            if placement.tpot_slo_s:
                self.slo_streams.setdefault(placement.target_replica, {})[id(placement)] = placement

    def since_of(self, replica_id: str) -> Since:
        return self.since.setdefault(replica_id, Since())

    def end(self, placement: Placement) -> None:
        self.first_token(placement)
        if _remote_prefill_on(placement) and not placement.ended:
            _decrement(self.prefilling, placement.prefill_replica)
        for replica_id, num_seqs in _touched(placement):
            _decrement(self.inflight, replica_id, num_seqs)
        if placement.target_replica and placement.tpot_slo_s and not placement.ended:
            streams = self.slo_streams.get(placement.target_replica)
            if streams is not None:
                streams.pop(id(placement), None)
                if not streams:
                    del self.slo_streams[placement.target_replica]
        placement.ended = True

    def prefill_done(self, placement: Placement, now: float | None = None, num_tokens: int = 0) -> None:
        """The first token is back: a disaggregated request no longer loads its prefill
        replica (it decodes elsewhere), so `max_prefill_queue` counts prefills only. With
        `now` (the policy's clock) and the tokens that came with it, its streams' progress
        is tracked from here on (`streamed`)."""
        if now is not None and not placement.first_token:
            placement.first_token_at, placement.tokens_back = now, num_tokens
        self.first_token(placement)
        if placement.prefill_replica and not placement.prefill_released:
            if _remote_prefill_on(placement) and not placement.ended:
                _decrement(self.prefilling, placement.prefill_replica)
            placement.prefill_released = True
            _decrement(self.inflight, placement.prefill_replica)

    @staticmethod
    def streamed(placement: Placement, num_tokens: int) -> None:
        """More of the placement's tokens are back (its streams' progress)."""
        placement.tokens_back += num_tokens

    def first_token(self, placement: Placement) -> None:
        """Idempotent: the prompt is computed; it no longer queues anyone's prefill."""
        if placement.first_token:
            return
        placement.first_token = True
        if placement.prefill_on:
            self._drop_answered((placement.decision.route, placement.prefill_on))
            _decrement(self.backlog, placement.prefill_on, placement.prefill_tokens)
            _decrement(self.backlog_work, placement.prefill_on, placement.prefill_work)
            if placement.decision.yield_prefill:
                _decrement(self.background_backlog, placement.prefill_on, placement.prefill_tokens)
                _decrement(self.background_backlog_work, placement.prefill_on, placement.prefill_work)
            self.since_of(placement.prefill_on).done.add(placement.prefill_tokens, placement.prefill_work)
        if placement.target_replica:
            _decrement(self.awaiting_first, placement.target_replica, placement.num_sequences)
            if _prefills_elsewhere(placement):
                waiting = self.incoming.get(placement.target_replica, {})
                waiting.pop(id(placement), None)
                if not waiting:
                    self.incoming.pop(placement.target_replica, None)

    def _background_chunk(self, replica_id: str) -> int:
        """The chunk of this router's first background prefill still waiting for its first
        token on `replica_id` (0: none, or the engine's own chunk)."""
        if not self.background_backlog.get(replica_id):
            return 0
        for p in self.waiting.get(("local", replica_id), ()):
            if p.decision.yield_prefill and not p.first_token:
                return (p.decision.candidate.chunk_tokens or 0) if p.decision.candidate is not None else 0
        return 0

    def _drop_answered(self, key: tuple[str, str]) -> None:
        queue = self.waiting.get(key)
        while queue and queue[0].first_token:
            queue.popleft()
        if queue is not None and not queue:
            del self.waiting[key]


def _prefills_elsewhere(placement: Placement) -> bool:
    return placement.prefill_on is not None and placement.prefill_on != placement.target_replica


def _remote_prefill_on(placement: Placement) -> bool:
    """Its prompt is still being computed on a prefill replica for another replica."""
    return bool(placement.prefill_replica) and not placement.prefill_released and \
        placement.prefill_replica != placement.target_replica


def _touched(placement: Placement) -> list[tuple[str, int]]:
    """(replica, sequences counted there): every stream where it decodes, one prefill."""
    prefill = None if placement.prefill_released else placement.prefill_replica
    counted = ((placement.target_replica, placement.num_sequences), (prefill, 1))
    return [(r, n) for r, n in counted if r]


def _decrement(counter: Counter, key, amount: int = 1) -> None:
    counter[key] -= amount
    if counter[key] <= 0:
        del counter[key]
