"""The calibration file: what `pdcluster plan` knows about one model on one device.

One JSON file names the model, the engine version, the device and dtype it was measured
on, the engine limits the simulator follows (token budget, `max_num_seqs`, KV capacity),
the fitted step-cost model (the same `StepCoefficients` the `auto` policy learns online),
the KV transfer cost, and how well the step model predicts step records it was not
fitted on. Nothing in it is invented: every number comes from records of a real engine
(a live deployment, a run directory, or an offline sweep on this machine).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from workers.engine.cost_model import StepCoefficients
from workers.engine.transfer_cost import TransferCoefficients

FORMAT_VERSION = 1
Source = Literal["live", "run", "sweep"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StepModel(_Strict):
    """c0..c4 of `workers/engine/cost_model.py`, seconds per unit."""

    fixed_s: float = Field(ge=0)
    prefill_token_s: float = Field(ge=0)
    prefill_attention_s: float = Field(ge=0)
    decode_seq_s: float = Field(ge=0)
    decode_context_s: float = Field(ge=0)
    num_samples: int = Field(default=0, ge=0)
    node_contention: float = Field(default=0.0, ge=0)  # per other busy engine of the node
    node_stream_contention: float = Field(default=0.0, ge=0)  # per decode sequence-step a second of the node

    def coefficients(self) -> StepCoefficients:
        return StepCoefficients(**self.model_dump())

    @classmethod
    def of(cls, c: StepCoefficients) -> StepModel:
        return cls(**c.to_dict())


class TransferModel(_Strict):
    """seconds = fixed_s + bytes / bytes_per_s (None: no cost per byte measured)."""

    fixed_s: float = Field(ge=0)
    bytes_per_s: float | None = Field(default=None, gt=0)
    num_samples: int = Field(default=0, ge=0)
    path: str = "tcp"  # the transport path the samples came from (tcp, shm, cuda_ipc, nccl)

    def coefficients(self) -> TransferCoefficients:
        return TransferCoefficients.from_dict(self.model_dump(exclude={"path"}))

    @classmethod
    def of(cls, c: TransferCoefficients, path: str = "tcp") -> TransferModel:
        return cls(**c.to_dict(), path=path)


class EngineLimits(_Strict):
    """The scheduler rules a simulated replica follows (`EngineSettings` of the run)."""

    block_size: int = Field(ge=1)
    num_kv_blocks: int = Field(ge=1)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    enable_prefix_caching: bool = True
    kv_bytes_per_token: int = Field(ge=1)  # all layers, K and V
    num_layers: int = Field(ge=1)


class FitQuality(_Strict):
    """How the step model did on held-out records (every k-th record, never fitted on)."""

    median_relative_error: float = Field(ge=0)
    p90_relative_error: float = Field(ge=0)
    num_fitted: int = Field(ge=0)
    num_held_out: int = Field(ge=0)
    # Where the records carry the engine thread's CPU time: the median error of the work
    # alone (the model's shape, fitted on CPU time) on the held-out steps' CPU time, and
    # the held-out steps' mean wait for a core over their mean CPU time (how crowded the
    # node was: the wall-time error above is mostly that wait's scatter). None otherwise.
    work_median_relative_error: float | None = Field(default=None, ge=0)
    run_wait_share: float | None = Field(default=None, ge=0)
    # Steps of the same shape (the model's every feature alike) and the median error of
    # the best time for each shape (`fit.same_shape_spread`): what no function of the
    # features can predict, about the floor under `median_relative_error`; the share of
    # the records in such groups. None: too few alike.
    same_shape_spread: float | None = Field(default=None, ge=0)
    same_shape_share: float | None = Field(default=None, ge=0, le=1)


class Calibration(_Strict):
    format_version: int = FORMAT_VERSION
    model: str  # the model folder's name (or the served model id)
    engine_version: str  # pdcluster's version that produced the records
    device: str  # cpu, cuda, or the GPU's name
    dtype: str  # float32, bfloat16, float16
    source: Source
    created_at: float  # unix seconds
    limits: EngineLimits
    step: StepModel  # what a simulated step costs (fitted on the mean step time)
    transfer: TransferModel
    quality: FitQuality
    # What the replicas' own online fit (relative error) would report in their heartbeats,
    # so the simulated router predicts as the real one did; None: `step`.
    reported_step: StepModel | None = None
    # The serving path's queue (`sim/frontend.py`): work per request and per streamed
    # chunk, fitted to runs' client-side latencies; None: not modelled.
    frontend_request_s: float | None = Field(default=None, ge=0)
    frontend_chunk_s: float | None = Field(default=None, ge=0)
    # Measured outside the engine: the HTTP hop, tokenisation and the router, per request.
    request_overhead_s: float = Field(default=0.0, ge=0)
    notes: str = ""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.model_dump(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        data = json.loads(Path(path).read_text())
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{path}: calibration format {data.get('format_version')!r}, this pdcluster reads "
                             f"{FORMAT_VERSION}; run `pdcluster plan calibrate` again")
        return cls.model_validate(data)
