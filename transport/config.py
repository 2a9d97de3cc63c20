"""`TransportConfig`: what users write in the cluster config's `transport:` section."""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from transport.transfers import Bounds
from transport.wire import WireLimits

KEY_ENV = "PDC_TRANSPORT_KEY"
Backend = Literal["zmq", "nccl", "shm", "local", "auto"]


class TransportConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    backend: Backend = "auto"
    # Bind address. None: this node's reachable IP (Ray's node IP or the default route's
    # source), which is also what is advertised. "0.0.0.0" binds everywhere and still
    # advertises the reachable IP. Tests use "127.0.0.1".
    host: str | None = None
    port: int = Field(0, ge=0, le=65535)  # 0 = any free port; the real one is advertised
    node_id: str | None = None  # None: derived from hostname + kernel boot id
    connect_timeout_s: float = Field(10.0, gt=0)
    transfer_timeout_s: float = Field(30.0, gt=0)  # sender: open -> receiver's ack
    reservation_ttl_s: float = Field(30.0, gt=0)  # receiver: expect -> complete
    max_layer_bytes: int = Field(1 << 30, gt=0)
    max_blocks_per_transfer: int = Field(1 << 16, gt=0)
    max_header_bytes: int = Field(16 << 10, ge=1024)
    shm_pool_bytes: int = Field(4 << 30, gt=0)  # per peer, same-node slots in flight
    # Shared key for header MACs: `key`, else `key_file`, else $PDC_TRANSPORT_KEY.
    key: SecretStr | None = None
    key_file: Path | None = None
    curve: bool = False  # CurveZMQ encryption of the control plane and inline payloads
    # zmq/shm/auto: move payloads between nodes over a per-pair TCP stream read straight into
    # the KV blocks (the `tcp` data path) rather than in ZMQ frames. Off with `curve` (its
    # payload is not encrypted). `data_port`: its listening port on `host`, 0 = any free one.
    direct_tcp: bool = True
    data_port: int = Field(0, ge=0, le=65535)

    @model_validator(mode="after")
    def _check_key_source(self) -> TransportConfig:
        if self.key_file is not None and not self.key_file.is_file():
            raise ValueError(f"transport.key_file: {self.key_file} is not a readable file")
        return self

    def resolve_key(self) -> bytes:
        """The MAC key; raises with the places it looked (never with the key itself)."""
        if self.key is not None:
            value = self.key.get_secret_value()
        elif self.key_file is not None:
            value = self.key_file.read_text().strip()
        else:
            value = os.environ.get(KEY_ENV, "")
        if len(value) < 16:
            raise ValueError(f"transport key missing or shorter than 16 characters: set "
                             f"transport.key, transport.key_file or ${KEY_ENV}")
        return value.encode()

    @property
    def bounds(self) -> Bounds:
        return Bounds(self.max_layer_bytes, self.max_blocks_per_transfer)

    @property
    def wire_limits(self) -> WireLimits:
        return WireLimits(max_header_bytes=self.max_header_bytes)


def generate_key() -> str:
    """A fresh random key, for a launcher that hands the same key to every replica."""
    return secrets.token_urlsafe(32)
