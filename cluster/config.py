"""The one typed config of a pdcluster deployment.

Users write YAML (or pass a dict as Serve application `args`); `load_config` validates it
into `ClusterConfig` and fails with a message naming the bad key, e.g.
`config error at prefill.num_replicas: Input should be greater than or equal to 0`.
Every section forbids unknown keys so a typo is an error, not a silently ignored line.

Secrets never live in the config itself: it names environment variables or files
(`SecretsConfig`), and `__repr__`/logging only ever see those names.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from transport.config import TransportConfig
from workers.faults import FaultSettings

Mode = Literal["auto", "threshold", "disagg", "local"]
DEFAULT_MODEL_CACHE = Path(os.environ.get("PDC_MODEL_CACHE", Path.home() / ".cache" / "pdcluster"))


class ConfigError(ValueError):
    """A config that cannot be used; the message names the offending key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Strict):
    """Which weights to serve: a HuggingFace folder (`path`) or an embedded `preset`."""

    path: str | None = None
    preset: Literal["tiny", "small"] | None = "tiny"  # made on first use when `path` is unset
    seed: int = 0
    name: str | None = None  # the id clients send as `model`; default: preset or folder name
    workload: str | None = None  # the model's workload profile (precedence: see router/profiles.py)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["cpu", "cuda"] | None = None  # None: cuda when the replica has a GPU
    max_model_len: int | None = Field(default=None, ge=2)  # None: the model's max positions
    cache_dir: str = str(DEFAULT_MODEL_CACHE)

    @model_validator(mode="after")
    def _path_or_preset(self) -> ModelConfig:
        if self.path is None and self.preset is None:
            raise ValueError("set model.path or model.preset")
        return self

    @property
    def served_name(self) -> str:
        if self.name:
            return self.name
        if self.path:
            return Path(self.path).name
        return str(self.preset)


class EngineSettings(_Strict):
    """`LLMEngine` keyword arguments shared by both pools."""

    block_size: int = Field(default=16, ge=1)
    num_kv_blocks: int | None = Field(default=None, ge=1)
    max_num_seqs: int = Field(default=64, ge=1)
    max_num_batched_tokens: int = Field(default=1024, ge=1)
    enable_prefix_caching: bool = True
    # Replay decode steps from captured CUDA graphs, for batches up to max_num_seqs
    # (None: on when the device is CUDA; true on a CPU is refused at start-up).
    cuda_graphs: bool | None = None
    # Run a few synthetic requests at start-up (about a second on a CPU) so the step-cost
    # model the router predicts with is fitted before the first real request.
    warmup: bool = True


class PoolConfig(_Strict):
    """One worker pool (prefill or decode): its size, placement and per-replica resources."""

    num_replicas: int = Field(default=1, ge=0)
    autoscaling_config: dict[str, Any] | None = None  # Serve's AutoscalingConfig; replaces num_replicas
    num_cpus: float = Field(default=1.0, ge=0)
    num_gpus: float = Field(default=0.0, ge=0)
    torch_threads: int | None = Field(default=1, ge=1)  # None: torch's default
    resources: dict[str, float] = Field(default_factory=dict)  # Ray custom resources (placement)
    max_ongoing_requests: int = Field(default=256, ge=1)
    engine: EngineSettings | None = None  # overrides the top-level `engine` for this pool
    # A replica being removed (scale-down, redeploy) serves its open streams this long, then
    # Serve kills it and they end with a 503 `replica_failed`; raise it for long outputs.
    graceful_shutdown_s: float = Field(default=5.0, ge=1.0, le=3600.0)

    @property
    def stream_drain_s(self) -> float:
        """How long a removed replica waits for its open worker-stream calls: the grace
        period less the time to leave the registry and stop the engine."""
        return max(0.5, self.graceful_shutdown_s - 2.0)

    @field_validator("autoscaling_config")
    @classmethod
    def _valid_autoscaling(cls, value: dict | None) -> dict | None:
        if value is None:
            return None
        from ray.serve.config import AutoscalingConfig

        try:
            AutoscalingConfig(**value)
        except Exception as e:  # ray's pydantic error text names the field
            raise ValueError(f"invalid Serve autoscaling_config: {e}") from None
        return value

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> PoolConfig:
        if self.autoscaling_config is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("set num_replicas or autoscaling_config, not both")
        return self

    @property
    def enabled(self) -> bool:
        """Whether this pool is expected to have replicas at all."""
        if self.autoscaling_config is not None:
            return int(self.autoscaling_config.get("max_replicas", 1)) > 0
        return self.num_replicas > 0

    def deployment_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options(...)`."""
        actor: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            actor["resources"] = dict(self.resources)
        if self.torch_threads is not None:
            threads = str(self.torch_threads)
            actor["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}}
        options: dict[str, Any] = {"ray_actor_options": actor, "max_ongoing_requests": self.max_ongoing_requests,
                                   "graceful_shutdown_timeout_s": self.graceful_shutdown_s}
        if self.autoscaling_config is not None:
            options["autoscaling_config"] = dict(self.autoscaling_config)
        else:
            options["num_replicas"] = self.num_replicas
        return options


class SLO(_Strict):
    """Latency objectives of one workload: a request is good (counts toward goodput) when
    its time to first token and its time per output token both meet them."""

    ttft_ms: float = Field(default=2000.0, gt=0)  # arrival at the router to the first token
    tpot_ms: float = Field(default=200.0, gt=0)  # mean gap between output tokens after the first


class RouterSettings(_Strict):
    num_replicas: int = Field(default=1, ge=1)
    num_cpus: float = Field(default=1.0, ge=0)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    prefill_timeout_s: float = Field(default=30.0, gt=0)  # remote prefill + transfer, then local
    request_timeout_s: float = Field(default=600.0, gt=0)  # whole request, router side
    state_poll_interval_s: float = Field(default=0.5, gt=0, le=1.0)  # profiles reach routers < 2 s
    heartbeat_timeout_s: float = Field(default=3.0, gt=0)  # replica unhealthy after this silence
    offload_local_to_prefill: bool = True  # a local request may run whole on a prefill replica (router/placement.py)
    # `generate` travels over an authenticated ZeroMQ stream from the router to the chosen
    # replica (workers/stream/client.py); false: through Serve handles (a few ms more per hop)
    worker_stream: bool = True
    prefix_index_blocks: int = Field(default=65536, ge=1)  # remembered block hashes per replica
    default_slo: SLO = Field(default_factory=SLO)  # for profiles that set no `slo`
    # `auto`: the share of requests that may re-probe a route whose measurements are stale
    # (only where both routes are predicted to meet the SLO), and when a route counts as stale
    explore_fraction: float = Field(default=0.02, ge=0.0, le=0.02)
    stale_after_s: float = Field(default=20.0, gt=0)
    correction_half_life_s: float = Field(default=60.0, gt=0)  # a correction's evidence fades with age
    transfer_cost_max_age_s: float = Field(default=60.0, gt=0)  # prefill replicas forget older KV transfer tails
    # the router process's young-generation GC threshold, after freezing what start-up
    # allocated (router/gc_tuning.py); null leaves Python's collector as it is
    gc_gen0_threshold: int | None = Field(default=5000, ge=100)


class WorkloadProfile(_Strict):
    """How one workload is routed; the body of `PUT /admin/workloads/NAME`."""

    mode: Mode = "auto"
    slo: SLO | None = None  # None: `router.default_slo`
    # `threshold` only: prefill remotely at this many uncached tokens
    min_remote_prefill_tokens: int = Field(default=256, ge=0)
    max_prefill_queue: int = Field(default=4, ge=0)
    # threshold, a prompt spilled to the decode replica: above this many uncached tokens it
    # prefills in the background, yielding to the streams there (`yield_to_decode`); at
    # most this (about one engine chunk: each stream beside it stalls once) it runs at once
    max_local_prefill_tokens_while_decoding: int = Field(default=512, ge=0)
    allow_client_override: bool = True
    deadline_s: float | None = Field(default=None, gt=0)  # per-request deadline (reliability)


class LimitsConfig(_Strict):
    default_max_tokens: int = Field(default=256, ge=1)
    max_tokens_limit: int = Field(default=4096, ge=1)  # a larger max_tokens is a 400 naming this limit

    @model_validator(mode="after")
    def _default_within_limit(self) -> LimitsConfig:
        if self.default_max_tokens > self.max_tokens_limit:
            raise ValueError("default_max_tokens must be <= max_tokens_limit")
        return self


class AdmissionSettings(_Strict):
    """Per router replica: how many requests run at once and how many may wait for a slot
    (interactive before batch); beyond that, or after `queue_timeout_s` queued, a 429 with
    `Retry-After`. Per-tenant rate and concurrency quotas come from the API keys file
    (router/tenants.py)."""

    max_concurrent_requests: int = Field(default=256, ge=1)
    max_queued_requests: int = Field(default=512, ge=0)
    queue_timeout_s: float = Field(default=30.0, gt=0)


class TLSSettings(_Strict):
    """HTTPS for the ingress (Serve's proxy `http_options`); both files or neither."""

    certfile: str | None = None
    keyfile: str | None = None
    keyfile_password_env: str | None = None  # the variable holding the key's password, if any

    @model_validator(mode="after")
    def _both_or_neither(self) -> TLSSettings:
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError("set both certfile and keyfile, or neither")
        return self

    @property
    def enabled(self) -> bool:
        return self.certfile is not None


class SecretsConfig(_Strict):
    """Where each secret comes from: a file path here, else the named environment variable."""

    admin_token_env: str = "PDC_ADMIN_TOKEN"
    admin_token_file: str | None = None
    # The transport key: `transport.key_file` first (order in `cluster.app.transport_key`)
    transport_key_env: str = "PDC_TRANSPORT_KEY"
    transport_key_file: str | None = None
    api_keys_file_env: str = "PDC_API_KEYS_FILE"  # the variable holds a path, as in INTERFACES.md
    api_keys_file: str | None = None

    def admin_token(self) -> str | None:
        return _read_secret(self.admin_token_file, self.admin_token_env)

    def api_keys_path(self) -> Path | None:
        path = self.api_keys_file or os.environ.get(self.api_keys_file_env) or None
        return Path(path) if path else None


def _read_secret(file: str | None, env: str) -> str | None:
    if file:
        try:
            value = Path(file).read_text().strip()
        except OSError as e:
            raise ConfigError(f"cannot read secret file {file}: {e.strerror}") from None
        return value or None
    return os.environ.get(env) or None


def _default_workloads() -> dict[str, WorkloadProfile]:
    return {"default": WorkloadProfile()}


class ClusterConfig(_Strict):
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    prefill: PoolConfig = Field(default_factory=PoolConfig)
    decode: PoolConfig = Field(default_factory=PoolConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)  # options: transport/config.py
    router: RouterSettings = Field(default_factory=RouterSettings)
    workloads: dict[str, WorkloadProfile] = Field(default_factory=_default_workloads)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    secrets: SecretsConfig = Field(default_factory=SecretsConfig)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)  # router queue bounds
    tls: TLSSettings = Field(default_factory=TLSSettings)
    faults: FaultSettings = Field(default_factory=FaultSettings)  # test-only; off unless enabled
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @field_validator("workloads")
    @classmethod
    def _has_default(cls, value: dict[str, WorkloadProfile]) -> dict[str, WorkloadProfile]:
        value = dict(value)
        value.setdefault("default", WorkloadProfile())
        for name in value:
            if not name or len(name) > 64:
                raise ValueError(f"workload name {name!r} must be 1-64 characters")
        return value

    @model_validator(mode="after")
    def _profiles_exist(self) -> ClusterConfig:
        if self.model.workload is not None and self.model.workload not in self.workloads:
            raise ValueError(f"model.workload {self.model.workload!r} is not in workloads")
        if not self.decode.enabled and not self.prefill.enabled:
            raise ValueError("at least one of decode and prefill must have replicas")
        return self

    def engine_for(self, role: Literal["prefill", "decode"]) -> EngineSettings:
        pool = self.prefill if role == "prefill" else self.decode
        return pool.engine or self.engine

    def to_args(self) -> dict[str, Any]:
        """Plain data for Serve `args` / `.bind(...)`: round-trips through `load_config`.

        Only the fields that were set: a default dumped back would count as set on
        reload and trip the checks that tell "given" from "defaulted" (an autoscaled
        pool must not also name `num_replicas`)."""
        return self.model_dump(mode="json", exclude_unset=True)


def load_config(source: str | Path | dict | ClusterConfig | None = None) -> ClusterConfig:
    """Validate a config from a YAML/JSON file, a dict (e.g. Serve `args`) or nothing.

    A dict may hold `config_file: PATH`; that file is loaded first and the dict's other
    keys are merged over it, so a Serve config can point at a file and override a few keys.
    """
    if isinstance(source, ClusterConfig):
        return source
    data = _read_source(source)
    try:
        return ClusterConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e)) from None


def _read_source(source: str | Path | dict | None) -> dict:
    if source is None:
        return {}
    if isinstance(source, dict):
        data = copy.deepcopy(source)
        file = data.pop("config_file", None)
        return _deep_merge(_read_file(Path(file)), data) if file else data
    return _read_file(Path(source))


def _read_file(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return data


def _deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"]) or "(top level)"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"config error at {key}: {message}")
    return "\n".join(lines)
