"""The chance that a long prompt lands beside a request run whole on a prefill replica.

Remote prefills arrive at a prefill replica in lumps: one long prompt, computed in a few
full-budget chunks, stalls a request decoding there for seconds, which a mean stretch of
its gaps (`replica_steps.prompt_share`) prices at a few percent. `auto` multiplies the `whole`
candidate's chance of meeting its TPOT objective by the chance that no such prompt lands
while it decodes.
"""

from __future__ import annotations

import math

from router.arrival_rate import WINDOW_S as ARRIVAL_WINDOW_S
from router.candidate import RequestShape
from router.queue_drain import own_prompt
from router.replica_load import ReplicaLoad


def burst_miss_chance(req: RequestShape, r: ReplicaLoad, tpot_s: float, slo_tpot_s: float) -> float:
    """The chance that a prompt arriving at `r` while this request decodes there alone
    would push its TPOT past `slo_tpot_s`: prompts arrive as they did over the last
    window (Poisson, at the rate of those whose prefill alone outlasts the slack the
    request's own gaps leave), this request among them where it is such a prompt itself:
    it has just arrived. Counted from the window alone, the first long prompt after a
    spell of short ones found nothing to fear on an idle prefill replica, ran whole there,
    and the long prompts that followed it prefilled beside its decode (the load shift:
    66 of the 71 requests run whole missed their TPOT objective in simulated bench traces;
    counted, 9 ran whole). Exposed for the request's decode; 0 where it already misses (the
    prediction prices that) or generates one token."""
    tokens_left = req.max_tokens - 1
    slack_s = tokens_left * (slo_tpot_s - tpot_s)
    if tokens_left < 1 or slack_s <= 0.0:
        return 0.0
    c = r.coefficients

    def stalls(tokens: float, work: float) -> bool:
        return tokens * c.prefill_token_s + work * c.prefill_attention_s > slack_s

    num_long = sum(1 for tokens, work in r.recent_prompts if stalls(tokens, work))
    own = own_prompt(0, req.prompt_len, r.chunk_tokens)
    num_long += 1 if stalls(own.tokens, own.work) else 0
    return 1.0 - math.exp(-num_long / ARRIVAL_WINDOW_S * tokens_left * tpot_s)
