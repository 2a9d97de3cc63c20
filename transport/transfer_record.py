"""What a sender keeps of each completed KV transfer (`KVSender.transfer_records`).

Plain data with no heavy imports: the worker stream carries these to the router's
`GET /admin/steps`, and the router does not load torch for it.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TRANSFER_RECORDS = 4096  # recent transfers a sender keeps


@dataclass(frozen=True)
class TransferRecord:
    """One completed KV transfer, as its sender saw it: for a cost model of transfers."""

    transfer_id: str
    num_bytes: int  # payload bytes handed to the sink
    num_layers: int
    data_path: str  # the data path that carried the layers (the backend's name for `local`)
    start_time: float  # time.time() when the engine handed the first layer
    seconds: float  # from the first layer handed to the receiver's acknowledgement
    # from the last layer handed (the prefill engine is done with the prompt) to the
    # acknowledgement: what the transfer adds to a request's time to first token
    tail_seconds: float
    # the receiver's advertised address the layers went to (`KVSender.open`'s
    # `peer_address`): which decode replica, for a cost model per (prefill, decode) pair.
    # Defaulted only so records written before it existed still build.
    peer: str = ""

    @property
    def ended_at(self) -> float:
        """When the transfer was acknowledged, which is when its sender recorded it."""
        return self.start_time + self.seconds
