"""Simulated executor: the latency model as the clock (DESIGN.md §2).

:class:`SimExecutor` implements the :class:`~conflux_jax.plan.Executor` protocol: it prices
each plan with a latency model from the plan alone (exact per-request KV lengths, not
batch means) and advances a virtual clock. It samples no real tokens (every token is 0).
"""

from __future__ import annotations

import random

from conflux_jax.latency import BatchShape, LatencyModel
from conflux_jax.plan import IterationPlan, KVSpec, Preparer, SampledToken, StepResult

_TOKEN = SampledToken(0)


class SimExecutor:
    """Virtual-clock executor. ``noise`` adds a seeded relative jitter to each step."""

    def __init__(self, model: LatencyModel, kv: KVSpec, start_s: float = 0.0,
                 noise: float = 0.0, seed: int = 0) -> None:
        if model.num_ranks != kv.num_ranks:
            raise ValueError("latency model and KV spec disagree on the number of ranks")
        self.model = model
        self._kv_spec = kv
        self._now = start_s
        self.noise = noise
        self._rng = random.Random(seed)
        self.iterations = 0
        self.busy_s = 0.0

    @property
    def num_ranks(self) -> int:
        return self._kv_spec.num_ranks

    @property
    def kv(self) -> KVSpec:
        return self._kv_spec

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        """Idle until ``t`` (no-op if the clock is already past it)."""
        if t > self._now:
            self._now = t

    def price(self, plan: IterationPlan) -> float:
        """Latency of ``plan`` from the plan's own lengths."""
        return self.model.estimate(BatchShape.from_plan(plan, self.num_ranks))

    def execute(self, plan: IterationPlan, prepare: Preparer | None = None) -> StepResult:
        if prepare is not None:  # masks constrain no simulated token, but run the caller's code
            prepare(plan)
        latency = self.price(plan)
        if self.noise:
            latency *= max(0.0, 1.0 + self._rng.gauss(0.0, self.noise))
        sampled = dict.fromkeys(plan.sampling_ids, _TOKEN)
        self._now += latency
        self.busy_s += latency
        self.iterations += 1
        return StepResult(sampled=sampled, latency_s=latency, end_s=self._now)
