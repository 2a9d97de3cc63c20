"""Each replica's last heartbeat as the router's view reads it (`from_stats`): parsed
once, when the poll brings it, so that no routing decision parses one.

A decision that parsed the heartbeat of each replica it priced, the first time it met it
after a poll, cost 0.87-0.98 ms at the median against 0.53 for the others (bench policy,
64 replicas): one decision in a hundred, the p99. A heartbeat polled again unchanged
keeps its parse. One that cannot be parsed (a replica of another version) is warned
about once and left to the decisions that price that replica; it never stops the poll
taking in the others.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from router.replica_info import ReplicaInfo
from router.replica_load import ReplicaLoad, from_stats
from workers.engine.cost_model import StepCoefficients

log = logging.getLogger(__name__)


class HeartbeatParses:
    def __init__(self) -> None:
        self._loads: dict[str, tuple[ReplicaInfo, ReplicaLoad]] = {}
        # per replica: its step model slowed by its busy neighbours, as last priced (`slowed`)
        self._slowed: dict[str, tuple[StepCoefficients, float, StepCoefficients]] = {}
        self._unreadable: set[str] = set()  # replicas whose last heartbeat could not be parsed

    def take_in(self, replicas: Iterable[ReplicaInfo]) -> None:
        """One poll's replicas: each heartbeat parsed, or its parse kept where unchanged."""
        old, self._loads = self._loads, {}
        self._slowed.clear()
        for r in replicas:
            kept = old.get(r.replica_id)
            if kept is not None and _same_heartbeat(kept[0], r):
                self._loads[r.replica_id] = (r, kept[1])
                continue
            try:
                self.load(r)
                self._unreadable.discard(r.replica_id)
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                if r.replica_id not in self._unreadable:  # once, not every poll
                    log.warning("heartbeat of replica %s cannot be read: %r", r.replica_id, e)
                self._unreadable.add(r.replica_id)

    def load(self, replica: ReplicaInfo) -> ReplicaLoad:
        """The replica's last heartbeat as it reported it (nothing of this router's since);
        parsed here for a replica the last poll did not bring (its stats are never changed
        in place: a poll brings new `ReplicaInfo`s)."""
        kept = self._loads.get(replica.replica_id)
        if kept is not None and kept[0] is replica:
            return kept[1]
        base = from_stats(replica.replica_id, replica.role, replica.stats, replica.address)
        self._loads[replica.replica_id] = (replica, base)
        return base

    def slowed(self, replica_id: str, base: ReplicaLoad, node_busy: float) -> StepCoefficients:
        """`base`'s step model beside `node_busy` busy neighbours, kept while both hold (the
        same few counts recur request after request)."""
        kept = self._slowed.get(replica_id)
        if kept is not None and kept[0] is base.coefficients and kept[1] == node_busy:
            return kept[2]
        slowed = base.coefficients.slowed(node_busy)
        self._slowed[replica_id] = (base.coefficients, node_busy, slowed)
        return slowed


def _same_heartbeat(old: ReplicaInfo, new: ReplicaInfo) -> bool:
    """`new` reports what `old` did (the same heartbeat, polled again): its parse holds."""
    return (old.stats is new.stats or old.stats == new.stats) and old.role == new.role and old.address == new.address
