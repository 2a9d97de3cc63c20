"""Fault injection for the reliability suite: KV transfers that arrive corrupt, stall,
or go out slowly.

Never active by default. A deployment opts in with the config section

    faults: {enabled: true, kv_transfer: corrupt, probability: 1.0, kv_layer_delay_s: 0.0}

and only then may a test change the fault at run time (`EngineWorker.set_faults`). With
`enabled: false` (the default) `wrap_sender` returns the sender untouched and
`set_faults` refuses, so a production config cannot reach this code by accident. Each
`set_faults(spec)` replaces the whole live fault: a field the spec leaves out takes its
default, so `{"kv_layer_delay_s": 0.05}` slows layers with no `kv_transfer` fault, and
`{"kv_transfer": "none"}` (what the suite sends between scenarios) also ends a delay.

The faults act at the sender's seams, not inside the transport:
- `corrupt`: the layer's payload checksum is flipped after the data path computed it
  (the header is then sealed with a valid HMAC), so the receiver sees exactly what a
  payload damaged in flight looks like and fails the transfer with `TransferCorrupt`;
- `stall`: the final DONE message is never sent, so the decode replica waits for its
  `prefill_timeout_s` and falls back, as it would on a hung link;
- `kv_layer_delay_s` > 0: every layer waits that long on the sender's channel thread
  before it goes out, as on a slow link. The engine's step thread only queues layers,
  so the prefill itself is not slowed: the transfer's exposed tail (time to first token)
  grows, and the layers arrive unchanged. Network senders only: the `local` backend has
  no channel thread, and is not delayed.
"""

from __future__ import annotations

import logging
import random
import time
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
    kv_layer_delay_s: float = Field(default=0.0, ge=0.0, allow_inf_nan=False)  # per layer sent


class FaultState:
    """The live fault of one replica (mutable: tests switch it between scenarios)."""

    def __init__(self, settings: FaultSettings) -> None:
        self.enabled = settings.enabled
        self.kv_transfer: KVFault = settings.kv_transfer if settings.enabled else "none"
        self.probability = settings.probability
        self.kv_layer_delay_s = settings.kv_layer_delay_s if settings.enabled else 0.0
        self.num_injected = 0  # transfers given a `kv_transfer` fault
        self.num_delayed_layers = 0

    def set(self, spec: dict) -> dict:
        if not self.enabled:
            raise PermissionError("fault injection is disabled in this deployment's config")
        settings = FaultSettings(enabled=True, **spec)
        self.kv_transfer, self.probability = settings.kv_transfer, settings.probability
        self.kv_layer_delay_s = settings.kv_layer_delay_s
        log.warning("fault injection now %s (p=%.2f), %.3f s a layer", self.kv_transfer, self.probability,
                    self.kv_layer_delay_s)
        return self.describe()

    def describe(self) -> dict:
        return {"enabled": self.enabled, "kv_transfer": self.kv_transfer,
                "probability": self.probability, "kv_layer_delay_s": self.kv_layer_delay_s,
                "num_injected": self.num_injected, "num_delayed_layers": self.num_delayed_layers}

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
        _fault_channel_path(sink, self._state)
        fault = self._state.draw()
        if fault == "none":
            return sink
        log.warning("transfer %s: injecting %s", transfer_id, fault)
        if fault == "corrupt":
            _MARKED.add(transfer_id)
            return sink
        return _StallingSink(sink)

    def close(self) -> None:
        self._sender.close()

    def __getattr__(self, name: str):
        return getattr(self._sender, name)


def _fault_channel_path(sink, state: FaultState) -> None:
    """Route the sink's channel's layers through `_FaultyPath` (once per channel; a sink
    without a channel, the `local` backend's, is left as is)."""
    channel = getattr(sink, "_channel", None)
    path = getattr(channel, "path", None)
    if path is None or isinstance(path, _FaultyPath):
        return
    channel.path = _FaultyPath(path, state)


class _FaultyPath:
    """Wraps a `transport.paths.base.SendPath`, so it runs on the channel's thread, never
    the engine's: holds each layer `state.kv_layer_delay_s`, and corrupts the first layer
    of a marked sink. Reads `state` per layer, so `set_faults` acts on open channels."""

    def __init__(self, inner, state: FaultState) -> None:
        self._inner, self._state = inner, state
        self.name = inner.name

    def payload(self, header, kv, checksum: int | None = None) -> list:
        delay = self._state.kv_layer_delay_s
        if delay > 0:
            self._state.num_delayed_layers += 1
            time.sleep(delay)
        frames = self._inner.payload(header, kv, checksum)
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
