"""The KV transfers a prefill replica has computed and still waits to see acknowledged.

A transfer's record, from which the replica learns its link's cost, arrives only once
the receiver acknowledged its last layer. On a link slowed to seconds a layer, the
requests sent down it meanwhile were priced as if it were still fast. What a replica
already knows earlier is how long each of its transfers has waited since its prompt was
computed (its exposed tail so far): the longest of them per decode peer goes out with
every heartbeat (`transfer_waiting_s`), and a remote prefill to that peer is priced with
at least that tail (`router/predict.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class TransferWaits:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._waiting: dict[str, tuple[str, float]] = {}  # transfer id -> (decode peer address, computed at)

    def computed(self, transfer_id: str, peer: str) -> None:
        """The prompt is computed and its last layer handed to the sender."""
        self._waiting[transfer_id] = (peer, self._clock())

    def acknowledged(self, transfer_id: str) -> None:
        """The transfer ended, acknowledged or failed: it waits no more."""
        self._waiting.pop(transfer_id, None)

    def longest(self) -> dict[str, float]:
        """Per decode peer address, the longest wait so far of a transfer still waiting
        there (seconds); {} when none waits."""
        now = self._clock()
        out: dict[str, float] = {}
        for peer, since in list(self._waiting.values()):
            out[peer] = max(out.get(peer, 0.0), round(now - since, 4))
        return out
