"""A worker replica's Prometheus metrics, in its own registry.

Each replica renders its registry as Prometheus text and sends it with every heartbeat;
the ControlPlane sums the counters and histograms of all replicas and keeps the gauges
per `pool`/`replica`, so `/metrics` on any router shows the whole cluster.
Engine counters (prefix-cache queries/hits, prompt tokens computed, preemptions) are mirrored from
`engine.stats()` by delta, so the engine stays the one owner of those facts. How long each
request waited in the engine for its first step is observed per request, as the engine
reports it (`AsyncEngine(on_queue_time=...)`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from workers.ray_metrics import mirror_into_ray

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# One family on `/metrics`, recorded by routers (stage "admission") and workers (stage "engine").
QUEUE_SECONDS = "pdc_request_queue_seconds"
QUEUE_HELP = ("Time a request waited before work began, by stage: admission (a router's slot; 0 when "
              "none was waited for) or engine (entering the engine to the step that first schedules "
              "it, on the replica that prefills it)")


class WorkerMetrics:
    """Recorded by a worker replica: its engine's stats on each heartbeat, its transfers
    and its requests' engine queue times as they happen."""

    def __init__(self, model: str, pool: str, replica: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model = model
        self._gauge_labels = {"model": model, "pool": pool, "replica": replica}
        r = self.registry
        self.kv_transfer_bytes = Counter(
            "pdc_kv_transfer_bytes", "KV bytes sent by prefill replicas", ["model"], registry=r)
        self.kv_transfer_seconds = Histogram(
            "pdc_kv_transfer_seconds", "Remote prefill + KV transfer time per request",
            ["model", "backend"], buckets=TRANSFER_BUCKETS, registry=r)
        self.prefix_queries = Counter(
            "pdc_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ["model"], registry=r)
        self.prefix_hits = Counter(
            "pdc_prefix_cache_hits", "Prompt tokens found in the prefix cache", ["model"], registry=r)
        self.prompt_tokens_computed = Counter(
            "pdc_prompt_tokens_computed", "Prompt positions run through the model, by pool (a prefix-cache hit "
            "is not computed; a recompute after preemption is); one prefill of n sequences counts once",
            ["model", "pool"], registry=r)
        self.background_requests = Counter(
            "pdc_background_prefills", "Requests prefilled in the background (prompts `auto` spilled "
            "onto a decode replica, yielding to its streams)", ["model"], registry=r)
        self.stream_calls = Counter(
            "pdc_worker_stream_calls", "Calls this pool's replicas took over the worker stream, by method "
            "(generate from routers, prefill from decode replicas)", ["model", "method"], registry=r)
        self.stream_rejected = Counter(
            "pdc_worker_stream_rejected", "Worker-stream messages refused (bad MAC, malformed, replayed, "
            "stale)", ["model"], registry=r)
        self.export_buffers = Counter(
            "pdc_export_buffers", "Large KV layers a prefill replica exported, by where the copy landed: "
            "a reused pooled buffer, a newly pooled one, or a fresh allocation (the pool at its bound)",
            ["model", "outcome"], registry=r)
        self.kv_rejections = Counter(
            "pdc_kv_transfer_rejections", "KV transfer messages and data connections decode replicas "
            "refused, by reason (bad_mac, replay, unknown, fingerprint, bounds, checksum, timeout, ...)",
            ["model", "reason"], registry=r)
        self.kv_received_bytes = Counter(
            "pdc_kv_received_bytes", "KV bytes decode replicas received, by data path (tcp, inline, "
            "shm, pg)", ["model", "path"], registry=r)
        self.step_seconds = Counter(
            "pdc_engine_step_seconds", "Engine steps that ran a batch, by part: their wall time, the engine "
            "thread's CPU time in them, and its time runnable but waiting for a core (a crowded node)",
            ["model", "pool", "part"], registry=r)
        self.engine_queue = Histogram(QUEUE_SECONDS, QUEUE_HELP, ["model", "stage"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        names = ("model", "pool", "replica")
        self.num_preemptions = Counter(
            "pdc_num_preemptions", "Running sequences the engine preempted (blocks freed, recomputed "
            "later) for lack of KV blocks", names, registry=r)
        self.num_preemptions.labels(model, pool, replica)  # shown at 0: none is a finding too
        self.export_pool_bytes = Gauge("pdc_export_pool_bytes", "Host memory held by a prefill replica's "
                                       "pool of export buffers", names, registry=r)
        self.blocks_free = Gauge("pdc_kv_blocks_free", "Free KV blocks", names, registry=r)
        self.blocks_total = Gauge("pdc_kv_blocks_total", "All KV blocks", names, registry=r)
        self.running = Gauge("pdc_num_requests_running", "Requests in the running batch", names, registry=r)
        self.waiting = Gauge("pdc_num_requests_waiting", "Requests queued in the engine", names, registry=r)
        self._last_stats: dict = {}
        mirror_into_ray(self)  # the same recordings also reach Ray's Prometheus export

    def record_transfer(self, num_bytes: int, seconds: float, backend: str) -> None:
        self.kv_transfer_bytes.labels(self.model).inc(num_bytes)
        self.kv_transfer_seconds.labels(self.model, backend).observe(seconds)

    def observe_engine_queue(self, seconds: float) -> None:
        self.engine_queue.labels(self.model, "engine").observe(seconds)

    def update_from_stats(self, stats: dict) -> None:
        """Copy engine stats into the gauges and counters."""
        labels = self._gauge_labels
        self._mirror(self.prefix_queries, stats, "prefix_cache_queries")
        self._mirror(self.prefix_hits, stats, "prefix_cache_hits")
        self._mirror(self.prompt_tokens_computed, stats, "num_prompt_tokens_computed", self._gauge_labels["pool"])
        self._mirror(self.background_requests, stats, "num_background_requests")
        self._mirror(self.num_preemptions, stats, "num_preemptions", labels["pool"], labels["replica"])
        self._mirror(self.stream_rejected, stats, "num_stream_rejected")
        for method in ("generate", "prefill"):
            self._mirror(self.stream_calls, stats, f"stream_{method}_calls_total", method)
        for outcome in ("reused", "allocated", "fallback"):
            self._mirror(self.export_buffers, stats, f"export_buffers_{outcome}_total", outcome)
        for part in ("wall", "cpu", "run_wait"):
            self._mirror(self.step_seconds, stats, f"step_{part}_seconds_total", labels["pool"], part)
        self._mirror_family(self.kv_rejections, stats, "kv_rejections_")
        self._mirror_family(self.kv_received_bytes, stats, "kv_received_bytes_")
        self.blocks_free.labels(**labels).set(stats.get("kv_blocks_free", 0))
        self.blocks_total.labels(**labels).set(stats.get("kv_blocks_total", 0))
        self.running.labels(**labels).set(stats.get("num_running", 0))
        self.waiting.labels(**labels).set(stats.get("num_waiting", 0))
        if "export_pool_bytes" in stats:
            self.export_pool_bytes.labels(**labels).set(stats["export_pool_bytes"])
        self._last_stats = dict(stats)

    def _mirror(self, counter: Counter, stats: dict, key: str, *labels: str) -> None:
        delta = stats.get(key, 0) - self._last_stats.get(key, 0)
        if delta > 0:
            counter.labels(self.model, *labels).inc(delta)

    def _mirror_family(self, counter: Counter, stats: dict, prefix: str) -> None:
        """Mirror every `<prefix><label>_total` stat, the label taken from its name."""
        for key in stats:
            if key.startswith(prefix) and key.endswith("_total"):
                self._mirror(counter, stats, key, key[len(prefix):-len("_total")])

    def render(self) -> str:
        return generate_latest(self.registry).decode()
