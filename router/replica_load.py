"""One replica as a prediction sees it: its learned step model and its queue.

`ReplicaLoad` is built by `ClusterView.load_of` from the replica's last heartbeat (the
step-cost model it fitted, the prompt tokens it has waiting, the streams it decodes,
the KV transfer costs it measured) combined with what this router sent it since that
heartbeat, so several router replicas stay consistent with each other. It is plain data:
`router/predict.py` prices candidates from it and a simulator can build it directly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from router.peer_links import PeerLinks
from workers.engine.cost_model import DEFAULT_COEFFICIENTS, StepCoefficients
from workers.engine.request_ids import origin_request_id
from workers.engine.transfer_cost import DEFAULT_TRANSFER, TransferCoefficients

DEFAULT_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    role: str  # "prefill" | "decode"
    # its step model as it prices a step now: slowed by its node's busy replicas (`node_busy`)
    coefficients: StepCoefficients = DEFAULT_COEFFICIENTS
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS  # the engine's token budget per step
    queue_tokens: int = 0  # prompt tokens waiting for compute ahead of a new request
    queue_work: int = 0  # their attention work (chunk tokens x context), in the engine's chunking
    # of the queue, background prefills: they drain beside the foreground prompts (`router/queue_drain.py`)
    background_tokens: int = 0
    background_work: int = 0
    background_chunk_tokens: int = 0  # the first one's chunk per decoding step (0: unknown)
    num_streams: int = 0  # sequences past their prompt, decoding
    stream_context: int = 0  # their context tokens, in total
    stream_tokens_left: float = 0.0  # tokens each stream still has to generate, on average
    # ascending, the mean gap each of this router's streams there can still afford over the
    # tokens it has left and meet its TPOT objective (its objective before its first token;
    # 0: past its budget already); () where it has none
    stream_allowances: tuple[float, ...] = ()
    # prompts queued here in the foreground that decode here too: they become streams
    # before a prompt queued now gets its chunks
    queued_streams: int = 0
    queued_context: int = 0  # their prompt tokens
    queued_tokens_left: float = 0.0  # tokens each will generate, on average
    num_requests: int = 0  # running + waiting: an idle replica has none
    kv_bytes_per_token: int = 0
    address: str | None = None  # the advertised KV transport address (a transfer's peer)
    # prefill replicas: the exposed transfer tail per decode peer address, "*" for any
    transfers: Mapping[str, TransferCoefficients] = field(default_factory=dict)
    # prefill replicas: per decode peer address, how long the transfer there that has waited
    # longest for its acknowledgement since its prompt was computed had waited, at the
    # heartbeat (`workers/transfer_waits.py`); absent: none waits
    transfer_waiting: dict[str, float] = field(default_factory=dict)
    # the mean gap between tokens its streams saw lately and their mean batch then
    # (`workers/engine/recent_load.py`); None: too few decoding steps lately
    recent_gap_s: float | None = None
    recent_decode_seqs: float = 0.0
    # route -> how far past its predicted TTFT the oldest request still waiting for its first
    # token from this replica's prefill is (>= 1; absent: none is late)
    overdue: dict[str, float] = field(default_factory=dict)
    # the prompts partly computed here at the heartbeat, by the id they came with: (tokens,
    # attention work) still to compute (`Scheduler.queue_stats`)
    prefill_progress: dict[str, tuple[int, int]] = field(default_factory=dict)
    arrival_rate: float = 0.0  # requests placed to decode here per second lately (`router/arrival_rate.py`)
    # prompt tokens placed to be computed here per second lately, and their attention work
    prompt_token_rate: float = 0.0
    prompt_work_rate: float = 0.0
    prompt_rate: float = 0.0  # prompts placed to be computed here per second lately
    # (tokens, attention work) of each prompt placed to be computed here over the same
    # window (`arrival_rate.WINDOW_S`), oldest first: what a stream here may find beside it
    # (filled where a request may run whole on the replica, the one candidate that reads it)
    recent_prompts: tuple[tuple[float, float], ...] = ()
    # (TTFT objective in seconds, how many requests placed to decode here over the same
    # window had it), ascending: who waits should a prompt hold its foreground lane (filled
    # for the decode replica a placement chose, the one its local candidates run on)
    arrival_ttft_objectives: tuple[tuple[float, int], ...] = ()
    # ascending, seconds until each request prefilling elsewhere that will decode here is
    # due, of those not counted among its streams yet (`router/incoming.py`; filled as
    # `arrival_ttft_objectives` is): they start decoding beside a prompt prefilled here now
    incoming_due_s: tuple[float, ...] = ()
    node_id: str = ""  # its machine ("": unknown, shares with no one)
    # the other replicas of its node busy now, already priced into `coefficients` (each
    # slows its steps by the step model's `node_contention`)
    node_busy: float = 0.0

    def evolve(self, **changes: object) -> ReplicaLoad:
        """`dataclasses.replace` without its per-call walk over the fields and `__init__`
        (the router evolves a heartbeat's load per candidate replica per request). The
        fields are plain data with no `__post_init__`, so copying them is the same thing."""
        if not changes.keys() <= _FIELD_NAMES:
            raise TypeError(f"ReplicaLoad has no field {sorted(changes.keys() - _FIELD_NAMES)}")
        new = object.__new__(ReplicaLoad)
        new.__dict__.update(self.__dict__, **changes)
        return new

    @property
    def stream_tpot_slo_s(self) -> float | None:
        """The least allowance above 0 (`stream_allowances`); None without any, infinity
        when each is past its budget."""
        if not self.stream_allowances:
            return None
        return next((a for a in self.stream_allowances if a > 0.0), math.inf)

    @property
    def busy(self) -> bool:
        """Computing now or about to: requests, queued prompt tokens or streams."""
        return self.num_requests > 0 or self.queue_tokens > 0 or self.num_streams > 0

    def shares_node_with(self, other: ReplicaLoad) -> bool:
        return bool(self.node_id) and self.node_id == other.node_id and self.replica_id != other.replica_id

    def transfer_to(self, peer: str | None) -> TransferCoefficients:
        return self.transfers.get(peer or "") or self.transfers.get("*") or DEFAULT_TRANSFER

    def tail_to(self, peer: str | None, num_bytes: float) -> float:
        """A transfer's exposed tail to `peer`: the learned cost of `num_bytes`, and at
        least what a transfer there still unacknowledged has already waited."""
        link = self.transfer_to(peer)
        return max(link.fixed_s + num_bytes / link.bytes_per_s, self.transfer_waiting.get(peer or "", 0.0))


_FIELD_NAMES = frozenset(f.name for f in fields(ReplicaLoad))


def from_stats(replica_id: str, role: str, stats: dict, address: str | None = None) -> ReplicaLoad:
    """What a heartbeat's stats say, with defaults for a replica that reports no model yet."""
    model = stats.get("step_model")
    coefficients = StepCoefficients.from_dict(model) if isinstance(model, dict) else DEFAULT_COEFFICIENTS
    streams = int(stats.get("num_decoding", 0))
    left = float(stats.get("decode_tokens_remaining", 0)) / streams if streams else 0.0
    transfers = PeerLinks(stats.get("transfer_model"))  # each peer's fit parsed when first priced
    return ReplicaLoad(
        replica_id, role, coefficients,
        chunk_tokens=int(stats.get("max_num_batched_tokens", DEFAULT_CHUNK_TOKENS)),
        queue_tokens=int(stats.get("prompt_tokens_waiting", 0)),
        queue_work=int(stats.get("prompt_attention_waiting", 0)),
        background_tokens=int(stats.get("background_tokens_waiting", 0)),
        background_work=int(stats.get("background_attention_waiting", 0)),
        background_chunk_tokens=int(stats.get("background_chunk_tokens", 0) or 0),
        num_streams=streams, stream_context=int(stats.get("decode_context_tokens", 0)),
        stream_tokens_left=left,
        num_requests=int(stats.get("num_running", 0)) + int(stats.get("num_waiting", 0)),
        kv_bytes_per_token=int(stats.get("kv_bytes_per_token", 0)), address=address, transfers=transfers,
        transfer_waiting=_waits(stats.get("transfer_waiting_s")),
        recent_gap_s=_positive(stats.get("recent_stream_gap_s")),
        recent_decode_seqs=float(stats.get("recent_decode_seqs", 0.0) or 0.0),
        prefill_progress=_progress(stats.get("prefill_progress")))


def _progress(report) -> dict[str, tuple[int, int]]:
    """`prefill_progress` keyed by the ids the requests came with; malformed entries dropped."""
    if not isinstance(report, dict):
        return {}
    return {origin_request_id(str(rid)): (int(left[0]), int(left[1])) for rid, left in report.items()
            if isinstance(left, (list, tuple)) and len(left) == 2}


def _positive(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def _waits(value: object) -> dict[str, float]:
    if not isinstance(value, dict):
        return {}
    return {str(peer): float(s) for peer, s in value.items() if isinstance(s, (int, float)) and s > 0}
