"""KV transfers over links with bandwidth, sharing each node's NIC.

A transfer costs the calibrated `fixed_s` (setup, handshakes: not shared), then its bytes
at the link's bandwidth. Each node has one full-duplex NIC of that bandwidth: transfers
leaving a node share its sending side and transfers entering a node share its receiving
side, by processor sharing (a transfer moves at bandwidth / the most transfers on either
of its two sides). A transfer within one node passes through that node's NIC too (both
sides): on a GPU node it would take NVLink or shared memory, which a calibration of
that path gives its own bandwidth. Rates change only when a transfer starts or ends, so
the fluid model is exact between those events.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

from workers.engine.transfer_cost import TransferCoefficients

Schedule = Callable[[float, Callable[[float], None]], None]


@dataclass(eq=False)
class _Flow:
    src: int
    dst: int
    left_bytes: float
    done: Callable[[float], None]
    rate: float = 0.0


class Network:
    def __init__(self, link: TransferCoefficients, schedule: Schedule) -> None:
        self.link = link
        self._schedule = schedule
        self._flows: list[_Flow] = []
        self._at = 0.0  # when the flows' bytes were last brought up to date
        self._version = itertools.count()
        self._current = -1  # the completion event that is still valid
        self.num_transfers = 0
        self.bytes_sent = 0.0

    def send(self, src_node: int, dst_node: int, num_bytes: float, now: float,
             done: Callable[[float], None]) -> None:
        """Start a transfer; `done(t)` runs when its last byte has arrived."""
        self.num_transfers += 1
        self.bytes_sent += num_bytes
        fixed = self.link.fixed_s
        if num_bytes <= 0 or math.isinf(self.link.bytes_per_s):
            self._schedule(now + fixed, done)
            return
        flow = _Flow(src_node, dst_node, float(num_bytes), done)
        self._schedule(now + fixed, lambda t: self._start(flow, t))

    def _start(self, flow: _Flow, now: float) -> None:
        self._advance(now)
        self._flows.append(flow)
        self._replan(now)

    def _advance(self, now: float) -> None:
        elapsed = now - self._at
        if elapsed > 0:
            for f in self._flows:
                f.left_bytes -= f.rate * elapsed
        self._at = now

    def _replan(self, now: float) -> None:
        sending: dict[int, int] = {}
        receiving: dict[int, int] = {}
        for f in self._flows:
            sending[f.src] = sending.get(f.src, 0) + 1
            receiving[f.dst] = receiving.get(f.dst, 0) + 1
        bandwidth = self.link.bytes_per_s
        for f in self._flows:
            f.rate = bandwidth / max(sending[f.src], receiving[f.dst])
        if not self._flows:
            return
        first = min(self._flows, key=lambda f: max(f.left_bytes, 0.0) / f.rate)
        version = next(self._version)
        self._current = version
        self._schedule(now + max(first.left_bytes, 0.0) / first.rate, lambda t: self._complete(version, t))

    def _complete(self, version: int, now: float) -> None:
        if version != self._current:
            return  # the rates changed since this was planned
        self._advance(now)
        finished = [f for f in self._flows if f.left_bytes <= 1e-6 * max(1.0, f.rate)]
        self._flows = [f for f in self._flows if f not in finished]
        self._replan(now)
        for f in finished:
            f.done(now)
