"""The simulator: the engine's driver loop on a virtual clock (SimExecutor), the paper's
baselines (their simulation-only parts) and the named policies the sweeps compare."""

from conflux_jax.sim.driver import RequestRecord, SimReport, simulate
from conflux_jax.sim.executor import SimExecutor

__all__ = ["RequestRecord", "SimExecutor", "SimReport", "simulate"]
