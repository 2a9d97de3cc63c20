"""The synthetic cluster of `pdcluster bench policy` (cluster/bench/policy.py): seeded
requests as a router sees them, and every replica's heartbeat as the ControlPlane
reports it (the stats keys `router/replica_load.from_stats` reads, and the load counts
placement reads)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np

from cluster.config import SLO
from router.cluster_view import ReplicaInfo
from router.policy import RequestWork
from workers.engine.cost_model import prefill_work

VOCAB = 32_000
MAX_PROMPT_LEN = 4096
NUM_SYSTEM_PROMPTS = 16
SLOS = (SLO(ttft_ms=1000, tpot_ms=50), SLO(ttft_ms=2000, tpot_ms=200), SLO(ttft_ms=10_000, tpot_ms=100))
KV_BYTES_PER_TOKEN = 131_072  # 32 layers x 8 KV heads x 128 x (K, V) x fp16
REPLICAS_PER_NODE = 8  # an 8-GPU node


@dataclass(frozen=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    work: RequestWork
    slo: SLO


class Workload:
    """Seeded requests: log-uniform prompt lengths; a third extend one of a few system
    prompts, a fifth extend an earlier conversation (prefix hits); some n > 1, prompt
    logprobs or a grammar."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.tokens = np.random.default_rng(seed)
        self.system_prompts = [self._tokens(self.rng.randint(64, 1024)) for _ in range(NUM_SYSTEM_PROMPTS)]
        self.conversations: list[list[int]] = []
        self.num_requests = 0

    def next(self) -> Request:
        rng = self.rng
        length = int(round(math.exp(rng.uniform(math.log(16), math.log(MAX_PROMPT_LEN)))))
        kind = rng.random()
        if kind < 0.2 and self.conversations:
            base = rng.choice(self.conversations)
        elif kind < 0.55:
            base = rng.choice(self.system_prompts)
        else:
            base = []
        length = min(MAX_PROMPT_LEN, max(length, len(base) + rng.randint(16, 256)))
        prompt = base + self._tokens(length - len(base))
        if len(self.conversations) < 256:
            self.conversations.append(prompt)
        else:
            self.conversations[rng.randrange(256)] = prompt
        work = RequestWork(num_sequences=rng.choice((2, 4, 8)) if rng.random() < 0.1 else 1,
                           prompt_logprobs=rng.random() < 0.05, guided=rng.random() < 0.05)
        max_tokens = rng.choice((1, 16, 64, 128, 256, 512, 1024))
        self.num_requests += 1
        return Request(f"req-{self.num_requests}", prompt, max_tokens, work, rng.choice(SLOS))

    def _tokens(self, n: int) -> list[int]:
        return self.tokens.integers(0, VOCAB, n).tolist()


class Heartbeats:
    """Every replica's heartbeat: a step model fitted once per replica (refitted a little
    each time, with the slowdown a busy neighbour adds), random queues and streams, on
    prefill replicas a transfer model per decode address; replicas share nodes
    `REPLICAS_PER_NODE` at a time, prefill and decode mixed."""

    def __init__(self, num_replicas: int, num_prefill: int, max_num_seqs: int, seed: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.rng = random.Random(seed)
        self.roles = {f"prefill-{i}": "prefill" for i in range(num_prefill)}
        self.roles |= {f"decode-{i}": "decode" for i in range(num_replicas - num_prefill)}
        self.addresses = {rid: f"tcp://10.0.{i // 200}.{i % 200 + 10}:5{i:04d}" for i, rid in enumerate(self.roles)}
        self.models = {rid: self._step_model() for rid in self.roles}
        self.chunks = {rid: self.rng.choice((512, 1024, 2048)) for rid in self.roles}
        order = list(self.roles)
        self.rng.shuffle(order)
        self.nodes = {rid: f"node-{i // REPLICAS_PER_NODE}" for i, rid in enumerate(order)}

    def next(self, now: float) -> list[ReplicaInfo]:
        return [ReplicaInfo(rid, role, node_id=self.nodes[rid], address=self.addresses[rid], last_heartbeat=now,
                            stats=self._stats(rid, role)) for rid, role in self.roles.items()]

    def _step_model(self) -> dict:
        u = self.rng.uniform
        return {"fixed_s": u(0.004, 0.015), "prefill_token_s": u(5e-5, 2e-4), "prefill_attention_s": u(1e-9, 1e-8),
                "decode_seq_s": u(1e-4, 5e-4), "decode_context_s": u(1e-7, 1e-6), "num_samples": 256,
                "node_contention": u(0.0, 0.5)}

    def _stats(self, rid: str, role: str) -> dict:
        rng, chunk = self.rng, self.chunks[rid]
        idle = rng.random() < (0.3 if role == "prefill" else 0.1)
        queued = [] if idle else [rng.randint(16, MAX_PROMPT_LEN) for _ in range(rng.randint(0, 6))]
        streams = 0 if idle or role == "prefill" else rng.randint(0, 48)
        model = {k: v * rng.uniform(0.95, 1.05) if k != "num_samples" else v for k, v in self.models[rid].items()}
        stats = {
            "num_running": streams + min(len(queued), 2), "num_waiting": max(0, len(queued) - 2),
            "kv_blocks_total": 8192, "kv_blocks_free": rng.randint(0, 8192), "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": chunk, "kv_bytes_per_token": KV_BYTES_PER_TOKEN, "step_model": model,
            "prompt_tokens_waiting": sum(queued),
            "prompt_attention_waiting": sum(prefill_work(0, n, chunk)[2] for n in queued),
            "num_decoding": streams, "decode_context_tokens": streams * rng.randint(100, 3000),
            "decode_tokens_remaining": streams * rng.randint(1, 500)}
        if role == "prefill":
            stats["transfer_model"] = self._transfer_model()
        return stats

    def _transfer_model(self) -> dict:
        u = self.rng.uniform
        peers = {self.addresses[rid]: {"fixed_s": u(5e-4, 5e-3), "bytes_per_s": u(1e9, 2.5e10), "num_samples": 64}
                 for rid, role in self.roles.items() if role == "decode"}
        return {**peers, "*": {"fixed_s": 2e-3, "bytes_per_s": 5e9, "num_samples": 64 * len(peers)}}
