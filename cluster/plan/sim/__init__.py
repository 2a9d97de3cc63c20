"""The `pdcluster plan` simulator: engine steps, KV transfers and the real router code on
a simulated clock (simulator.py walks one request through it)."""

from cluster.plan.sim.arrivals import Arrival, at_rate, from_config, from_trace
from cluster.plan.sim.config import SimConfig
from cluster.plan.sim.result import SimResult
from cluster.plan.sim.simulator import simulate

__all__ = ["Arrival", "SimConfig", "SimResult", "at_rate", "from_config", "from_trace", "simulate"]
