"""The one typed object describing a load test, validated once with clear messages."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

ENDPOINTS = ("completions", "chat")
MODES = ("auto", "threshold", "disagg", "local")  # as the router's x-pd-mode accepts
PROMPT_FORMATS = ("auto", "ids", "text")
DEFAULT_NUM_REQUESTS = 100


@dataclass(frozen=True)
class SLO:
    """Per-request latency objectives in milliseconds; None means no objective."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> SLO:
        """`ttft_ms=X,tpot_ms=Y,e2e_ms=Z`, any subset."""
        if not text:
            return cls()
        values = {}
        for part in text.split(","):
            key, sep, value = part.partition("=")
            key = key.strip()
            if not sep or key not in cls.__dataclass_fields__:
                raise ValueError(f"--slo: bad item {part!r}; use ttft_ms=X,tpot_ms=Y,e2e_ms=Z")
            values[key] = float(value)
        return cls(**values)

    def as_dict(self) -> dict[str, float]:
        return {k: v for k, v in vars(self).items() if v is not None}


@dataclass
class LoadTestConfig:
    """Everything `pdcluster loadtest` takes. Exactly one load shape: `rate` (open loop,
    gamma/Poisson), `concurrency` (closed loop), `ramp`, `trace` or `sweep`; none given
    means a closed loop at concurrency 1."""

    url: str
    out_dir: Path | None = None
    workload: str = "chat-short"
    rate: float | None = None
    burstiness: float = 1.0
    concurrency: int | None = None
    ramp: tuple[float, float] | None = None
    sweep: bool = False
    trace: Path | None = None
    duration_s: float | None = None
    num_requests: int | None = None
    seed: int = 0
    model: str | None = None
    endpoint: str = "completions"
    api_key: str | None = None
    slo: SLO = field(default_factory=SLO)
    clients: int = 1
    mode: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = True
    prompt_format: str = "auto"  # ids: token-id prompts; text; auto: probe the server
    timeout_s: float = 300.0  # one request, connect to last byte
    progress: bool = False
    plots: bool = True
    sweep_points: int = 5  # rates tried between 0 and the saturation throughput
    sweep_max_concurrency: int = 64  # the closed loop that measures saturation
    slo_attainment: float = 0.9  # a rate "meets the SLO" when this fraction of requests do
    save_steps: bool = False  # also write the deployment's steps.jsonl / transfers.jsonl into out_dir
    admin_token: str | None = None  # for save_steps (default $PDC_ADMIN_TOKEN); never recorded
    # replaces the first characters of every request's first message: the same lengths and
    # arrivals as an unsalted run of this seed, but no prefix-cache hit on a run salted otherwise
    prompt_salt: str | None = None
    save_metrics: bool = False  # sample the server's /metrics over the run into out_dir (server_metrics.py)

    def __post_init__(self) -> None:
        shapes = [self.rate is not None, self.concurrency is not None, self.ramp is not None,
                  self.trace is not None, self.sweep]
        if sum(shapes) > 1:
            raise ValueError("choose one load shape: --rate, --concurrency, --ramp, --trace or --sweep")
        if self.duration_s is not None and self.num_requests is not None:
            raise ValueError("give --duration or --num-requests, not both")
        _check(self.endpoint in ENDPOINTS, f"--endpoint must be one of {ENDPOINTS}")
        _check(self.mode is None or self.mode in MODES, f"--mode must be one of {MODES}")
        _check(self.prompt_format in PROMPT_FORMATS, f"prompt_format must be one of {PROMPT_FORMATS}")
        _check(self.rate is None or self.rate > 0, "--rate must be > 0")
        _check(self.burstiness > 0, "--burstiness must be > 0")
        _check(self.concurrency is None or self.concurrency >= 1, "--concurrency must be >= 1")
        _check(self.clients >= 1, "--clients must be >= 1")
        _check(self.duration_s is None or self.duration_s > 0, "--duration must be > 0")
        _check(self.num_requests is None or self.num_requests >= 1, "--num-requests must be >= 1")
        _check(not self.save_steps or self.out_dir is not None, "--save-steps needs --out")
        _check(not self.save_metrics or self.out_dir is not None, "--save-metrics needs --out")
        self.url = self.url.rstrip("/")

    @property
    def is_open_loop(self) -> bool:
        return self.rate is not None or self.ramp is not None or self.trace is not None

    @property
    def effective_num_requests(self) -> int | None:
        """The request bound: the one given, else 100 unless a duration bounds the run."""
        if self.num_requests is not None:
            return self.num_requests
        return None if self.duration_s is not None or self.trace is not None else DEFAULT_NUM_REQUESTS

    def request_headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json", **self.headers}
        if self.api_key:
            headers["authorization"] = f"Bearer {self.api_key}"
        if self.mode:
            headers["x-pd-mode"] = self.mode
        return headers

    def describe_shape(self) -> dict:
        if self.rate is not None:
            return {"kind": "open", "rate": self.rate, "burstiness": self.burstiness}
        if self.ramp is not None:
            return {"kind": "ramp", "start_rate": self.ramp[0], "end_rate": self.ramp[1]}
        if self.trace is not None:
            return {"kind": "trace", "file": str(self.trace)}
        if self.sweep:
            return {"kind": "sweep", "points": self.sweep_points}
        return {"kind": "closed", "concurrency": self.concurrency or 1}


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
