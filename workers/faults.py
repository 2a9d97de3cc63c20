"""Fault injection for the reliability suite: KV transfers that arrive corrupt or stall.

Never active by default. A deployment opts in with the config section

    faults: {enabled: true, kv_transfer: corrupt, probability: 1.0}

and only then may a test change the fault at run time (`EngineWorker.set_faults`). With
`enabled: false` (the default) `wrap_sender` returns the sender untouched and
`set_faults` refuses, so a production config cannot reach this code by accident.

The faults act at the sender's seams, not inside the transport:
- `corrupt`: the layer's payload checksum is flipped after the data path computed it
  (the header is then sealed with a valid HMAC), so the receiver sees exactly what a
  payload damaged in flight looks like and fails the transfer with `TransferCorrupt`;
- `stall`: the final DONE message is never sent, so the decode replica waits for its
  `prefill_timeout_s` and falls back, as it would on a hung link.
"""

from __future__ import annotations

import logging
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger("pdcluster.faults")
KVFault = Literal["none", "corrupt", "stall"]


class FaultSettings(BaseModel):
    """The `faults` config section."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = False  # without this, nothing below can ever take effect
    kv_transfer: KVFault = "none"
    probability: float = Field(default=1.0, ge=0.0, le=1.0)  # per transfer


class FaultState:
    """The live fault of one replica (mutable: tests switch it between scenarios)."""

    def __init__(self, settings: FaultSettings) -> None:
        self.enabled = settings.enabled
        self.kv_transfer: KVFault = settings.kv_transfer if settings.enabled else "none"
        self.probability = settings.probability
        self.num_injected = 0

    def set(self, spec: dict) -> dict:
        if not self.enabled:
            raise PermissionError("fault injection is disabled in this deployment's config")
        settings = FaultSettings(enabled=True, **spec)
        self.kv_transfer, self.probability = settings.kv_transfer, settings.probability
        log.warning("fault injection now %s (p=%.2f)", self.kv_transfer, self.probability)
        return self.describe()

    def describe(self) -> dict:
        return {"enabled": self.enabled, "kv_transfer": self.kv_transfer,
                "probability": self.probability, "num_injected": self.num_injected}

    def draw(self) -> KVFault:
        """The fault for one new transfer."""
        if self.kv_transfer == "none" or random.random() >= self.probability:
            return "none"
        self.num_injected += 1
        return self.kv_transfer


def wrap_sender(sender, state: FaultState):
    """`sender` itself when faults are disabled; else a sender that injects `state`'s fault."""
    if not state.enabled:
        return sender
    return _FaultySender(sender, state)


class _FaultySender:
    def __init__(self, sender, state: FaultState) -> None:
        self._sender, self._state = sender, state
        self.backend = getattr(sender, "backend", "unknown")

    def open(self, transfer_id: str, peer_address: str, layout, start_block: int = 0,
             timeout: float | None = None):
        sink = self._sender.open(transfer_id, peer_address, layout, start_block=start_block,
                                 timeout=timeout)
        fault = self._state.draw()
        if fault == "none":
            return sink
        log.warning("transfer %s: injecting %s", transfer_id, fault)
        if fault == "corrupt":
            _corrupt_channel_path(sink)
            _MARKED.add(transfer_id)
            return sink
        return _StallingSink(sink)

    def close(self) -> None:
        self._sender.close()

    def __getattr__(self, name: str):
        return getattr(self._sender, name)


def _corrupt_channel_path(sink) -> None:
    """Make the sink's channel flip the checksum of layers of sinks marked for it."""
    channel = getattr(sink, "_channel", None)
    path = getattr(channel, "path", None)
    if path is None or isinstance(path, _CorruptingPath):
        return
    channel.path = _CorruptingPath(path)


class _CorruptingPath:
    """Wraps a `transport.paths.base.SendPath`; corrupts the first layer of a marked sink."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.name = inner.name

    def payload(self, header, kv) -> list:
        frames = self._inner.payload(header, kv)
        if header.transfer_id in _MARKED:
            _MARKED.discard(header.transfer_id)
            header.checksum = (int(header.checksum or 0) ^ 0x5A5A5A5A) & 0xFFFFFFFFFFFFFFFF
        return frames

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


_MARKED: set[str] = set()  # transfer ids whose next layer goes out corrupt


class _StallingSink:
    """Delegates to a real sink but never sends DONE: the transfer hangs until timeouts."""

    def __init__(self, sink) -> None:
        self._sink = sink

    def on_complete(self, first_token_id: int, logprob=None, siblings=()) -> None:  # noqa: ARG002 - swallowed on purpose
        return None

    def __getattr__(self, name: str):
        return getattr(self._sink, name)
