"""The symptoms `doctor` knows: each a pure function of the evidence that returns the
findings it supports (none on a healthy deployment). Thresholds are named constants;
every finding carries the numbers it rests on and the technique or setting that fits.
"""

from __future__ import annotations

from cluster.doctor.evidence import Evidence
from cluster.doctor.failures import prefill_pool_down, rejections, timeouts
from cluster.doctor.finding import Check, Finding
from cluster.doctor.latency import queueing_dominates, transfer_dominates
from cluster.doctor.node import crowded_node
from cluster.doctor.pools import kv_pressure, pool_imbalance
from cluster.doctor.prefix import prefix_dynamic_first, prefix_structure
from cluster.doctor.routes import (
    disagg_slower,
    long_prompts_beside_streams,
    short_prompts_disaggregated,
)

__all__ = ["CHECKS", "SYMPTOMS", "Finding", "crowded_node", "diagnose", "disagg_slower", "kv_pressure", "long_prompts_beside_streams",
           "pool_imbalance", "prefill_pool_down", "prefix_dynamic_first", "prefix_structure", "queueing_dominates",
           "rejections", "short_prompts_disaggregated", "timeouts", "transfer_dominates"]

CHECKS: tuple[Check, ...] = (
    prefill_pool_down, prefix_dynamic_first, kv_pressure, disagg_slower, short_prompts_disaggregated,
    long_prompts_beside_streams, pool_imbalance, crowded_node, transfer_dominates, queueing_dominates, timeouts,
    rejections,
)
SYMPTOMS = ("prefill-pool-down", "prefix-dynamic-first", "kv-pressure", "disagg-slower",
            "short-prompts-disaggregated", "long-prompts-beside-streams", "prefill-saturated", "decode-saturated",
            "crowded-node", "transfer-dominates-ttft", "queueing-dominates-ttft", "timeouts", "rejections")


def diagnose(ev: Evidence) -> list[Finding]:
    return [finding for check in CHECKS for finding in check(ev)]
