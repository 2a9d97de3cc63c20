"""What is still to compute on a replica, as a router's `ClusterView` reckons it.

A replica's last heartbeat reports its queue (prompt tokens and their attention work,
and how far each partly computed prompt has got); the view adds the prompts this router
sent it since and takes off those that got their first token since (`pending`). Both
give way to what the replica computed since: the share of the reported queue its steps
drain in the heartbeat's age, at most `MAX_HEARTBEAT_AGE_S`; or, where this router
placed a foreground prompt there with nothing left to compute (`wake`), the prompts it
sent from then on, drained from that moment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.prompt_tally import Computed, Since, pending
from router.queue_drain import drain, share_of
from router.replica_load import ReplicaLoad

if TYPE_CHECKING:
    from router.cluster_view import ClusterView

MAX_HEARTBEAT_AGE_S = 1.0  # two heartbeat periods (`ClusterView.heartbeat_age`)


def queue_of(view: ClusterView, rid: str, base: ReplicaLoad, since: Since, done: Computed, node_busy: float,
             now: float | None) -> tuple[int, int, float]:
    """The prompt tokens still to compute on `rid` and their work (`pending`), and the
    share of the reported queue computed since the heartbeat."""
    slowdown = base.coefficients.slowdown(node_busy)
    if since.woke_at is not None and now is not None:  # computing this router's prompts since then
        ran = 1.0
        ran_tokens, ran_work = _ran_since_woken(view, rid, base, since,
                                                min(now - since.woke_at, MAX_HEARTBEAT_AGE_S) / slowdown)
    else:
        seconds = view.heartbeat_age(rid, now) / slowdown
        ran = share_of(view.drains.heartbeat_busy_s(rid, base), seconds) if base.queue_tokens > 0 else 0.0
        ran_tokens, ran_work = ran * base.queue_tokens, ran * base.queue_work
    return (pending(base.queue_tokens, view.backlog.get(rid, 0) - done.all.tokens, ran_tokens,
                    since.sent.tokens, since.done.tokens),
            pending(base.queue_work, view.backlog_work.get(rid, 0) - done.all.work, ran_work,
                    since.sent.work, since.done.work), ran)


def computed(view: ClusterView, replica_id: str, progress: dict[str, tuple[int, int]]) -> Computed:
    """Of this router's prompts still waiting for their first token on `replica_id`,
    what its last heartbeat says is computed already (`ReplicaLoad.prefill_progress`).
    The backlog counts each prompt whole until its first token: without this, a prompt
    nine tenths computed still counted whole, and a long remote prefill behind it was
    predicted a second late."""
    done = Computed()
    if not progress:
        return done
    for route in ("disagg", "local"):
        for p in view.waiting.get((route, replica_id), ()):
            left = progress.get(p.request_id) if p.request_id and not p.first_token else None
            if left is not None:
                done.add(max(0, p.prefill_tokens - left[0]), max(0, p.prefill_work - left[1]),
                         p.decision.yield_prefill)
    return done


def wake(view: ClusterView, replica_id: str, at: float, background: bool) -> None:
    """A prompt placed on `replica_id` at `at` (the policy's clock) with nothing left
    to compute there starts at once: from then on, the replica computes what this
    router sends it (`Since.woke_at`), so a prompt placed behind it counts only what
    is left of it. Counted whole until the next heartbeat instead, a short prompt
    queued behind another was priced as sharing a step with all of it after the
    step that computed it had begun, and came in at three quarters of its predicted
    TTFT (bench cluster, one short prompt ahead on an otherwise idle replica).
    Foreground prompts only: a background prefill drains a small chunk a step, which
    that pace (full-budget chunks) would take for done many steps early, so one
    placed there stops the clock until the next heartbeat."""
    replica, taken_at = view.replicas.get(replica_id), view.taken_at.get(replica_id)
    if replica is None or taken_at is None or at < taken_at:
        return
    since = view.since_of(replica_id)
    if background:
        since.woke_at = None
        return
    base = view.heartbeat_load(replica)
    queue = queue_of(view, replica_id, base, since, computed(view, replica_id, base.prefill_progress), 0.0, at)
    if queue[0] == 0:
        since.wake(at)


def _ran_since_woken(view: ClusterView, rid: str, base: ReplicaLoad, since: Since,
                     seconds: float) -> tuple[float, float]:
    """Prompt tokens (and work) computed on a replica `seconds` after it woke: the
    reported queue and what this router sent before were done by then, and the prompts it
    sent since have drained at their pace (`share_of`)."""
    tokens = since.sent.tokens - since.sent_before.tokens
    work = since.sent.work - since.sent_before.work
    share = share_of(view.drains.woken_busy_s(rid, base, tokens, work), seconds) if tokens > 0 else 0.0
    return (base.queue_tokens + since.sent_before.tokens + share * tokens,
            base.queue_work + since.sent_before.work + share * work)


class QueueDrains:
    """How long a replica's queue takes to drain, kept between reads: every candidate
    replica of every request ages its last heartbeat's queue by it, and a woken replica
    the prompts this router sent it since. Each is priced again only when its inputs
    change (a new heartbeat, another prompt sent); `ClusterView.update` clears them."""

    def __init__(self) -> None:
        self._heartbeat: dict[str, tuple[ReplicaLoad, float]] = {}
        self._woken: dict[str, tuple[ReplicaLoad, int, int, float]] = {}

    def clear(self) -> None:
        self._heartbeat.clear()
        self._woken.clear()

    def heartbeat_busy_s(self, replica_id: str, base: ReplicaLoad) -> float:
        """`Drain.busy_s` of the queue of the replica's last heartbeat (`base`, its
        `ClusterView.heartbeat_load`)."""
        cached = self._heartbeat.get(replica_id)
        if cached is None or cached[0] is not base:
            cached = self._heartbeat[replica_id] = (base, drain(base).busy_s)
        return cached[1]

    def woken_busy_s(self, replica_id: str, base: ReplicaLoad, tokens: int, work: int) -> float:
        """`Drain.busy_s` of the prompts this router sent the replica since it woke
        (`tokens` of `work`, queued alone beside its last heartbeat's streams)."""
        cached = self._woken.get(replica_id)
        if cached is None or cached[0] is not base or cached[1] != tokens or cached[2] != work:
            woken = base.evolve(queue_tokens=tokens, queue_work=work, background_tokens=0, background_work=0)
            cached = self._woken[replica_id] = (base, tokens, work, drain(woken).busy_s)
        return cached[3]
