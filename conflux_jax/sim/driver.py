"""The discrete-event simulation: arrivals fed to the engine's own driver loop.

:func:`simulate` is :class:`~conflux_jax.engine.core.EngineCore` with a
:class:`~conflux_jax.sim.executor.SimExecutor`: it feeds arrivals as the virtual clock
reaches them, runs iterations back to back, jumps the clock over idle gaps and records
per-token deadline compliance (§8.1, :mod:`conflux_jax.slo`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from conflux_jax import slo
from conflux_jax.engine.core import EngineCore
from conflux_jax.plan import IterationPlan, StepResult
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.router import Router
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim.executor import SimExecutor


@dataclasses.dataclass
class RequestRecord:
    """Per-request outcome of a simulation."""

    id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    tokens: int = 0
    first_token_s: float | None = None
    finish_s: float | None = None
    compliant: bool = True
    aborted: bool = False
    instance: int = 0  # which instance the router sent it to

    def token_at(self, t: float, ttft_slo_s: float, tbt_slo_s: float) -> None:
        """Record the next output token, produced at ``t``."""
        if self.tokens == 0:
            self.first_token_s = t
        if not slo.on_time(t, self.arrival_s, self.tokens, ttft_slo_s, tbt_slo_s):
            self.compliant = False
        self.tokens += 1


@dataclasses.dataclass
class SimReport:
    records: list[RequestRecord]
    iterations: int
    sim_seconds: float
    busy_seconds: float
    preemptions: int
    slo_claim_violations: int  # plans claiming to fit whose priced latency exceeded TBT
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0  # of which it served

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    @property
    def attainment(self) -> float:
        """Fraction of requests whose every token met its deadline (aborted = late)."""
        if not self.records:
            return 1.0
        ok = sum(1 for r in self.records if r.compliant and not r.aborted
                 and r.finish_s is not None)
        return ok / len(self.records)


class InstanceRun:
    """One simulated instance: its engine loop on its own virtual clock."""

    def __init__(self, scheduler: Scheduler, executor: SimExecutor,
                 records: dict[int, RequestRecord], slos: dict[int, tuple[float, float]],
                 tbt_slo_s: float,
                 on_plan: Callable[[IterationPlan, StepResult], None] | None = None) -> None:
        self.scheduler, self.executor = scheduler, executor
        self.core = EngineCore(scheduler, executor)
        self.records, self.slos, self.tbt_slo_s, self.on_plan = records, slos, tbt_slo_s, on_plan
        self.iterations = 0
        self.claim_violations = 0

    def add(self, req: Request) -> None:
        if not self.core.add(req):
            self.records[req.id].aborted = True

    def run_until(self, t: float, max_iterations: int) -> None:
        """Run iterations that start before ``t`` (all of them for ``t = inf``); an idle
        instance's clock jumps to ``t``."""
        ex = self.executor
        while ex.now() < t:
            if not self.core.has_work:
                if t != float("inf"):
                    ex.advance_to(t)
                return
            it = self.core.step()
            if it is None:
                if t == float("inf"):
                    raise RuntimeError("scheduler stalled: work left but nothing schedulable")
                ex.advance_to(t)
                return
            result = it.result
            # The scheduler's claim against the truth's clock: estimate error (and noise).
            if it.plan.fits_slo and result.latency_s > self.tbt_slo_s * (1 + 1e-9):
                self.claim_violations += 1
            end = result.end_s
            for rid in result.sampled:
                self.records[rid].token_at(end, *self.slos[rid])
            for rid in it.finished:
                self.records[rid].finish_s = end
            if self.on_plan is not None:
                self.on_plan(it.plan, result)
            self.iterations += 1
            if self.iterations >= max_iterations:
                raise RuntimeError(f"simulation exceeded {max_iterations} iterations")


def simulate(requests: Sequence[Request], scheduler: Scheduler, executor: SimExecutor,
             ttft_slo_s: float, tbt_slo_s: float, max_iterations: int = 10_000_000,
             on_plan: Callable[[IterationPlan, StepResult], None] | None = None
             ) -> SimReport:
    """Run ``requests`` to completion in virtual time; ``on_plan(plan, result)`` is an
    optional hook (tests use it to check invariants)."""
    return simulate_routed(requests, [(scheduler, executor)], None, ttft_slo_s, tbt_slo_s,
                           max_iterations, on_plan)


def simulate_routed(requests: Sequence[Request],
                    instances: Sequence[tuple[Scheduler, SimExecutor]],
                    router: Router | None, ttft_slo_s: float, tbt_slo_s: float,
                    max_iterations: int = 10_000_000,
                    on_plan: Callable[[IterationPlan, StepResult], None] | None = None
                    ) -> SimReport:
    """Run ``requests`` through several instances behind ``router`` (Fig. 9 ①).

    Each instance keeps its own virtual clock; before each arrival every instance runs the
    iterations that start before it, so the router reads each instance's state as of the
    arrival (an iteration in flight is reported as started, as a live replica would).
    ``router`` may be None with one instance.
    """
    if router is None and len(instances) != 1:
        raise ValueError("several instances need a router")
    reqs = sorted(requests, key=lambda r: (r.arrival_s, r.id))
    recs = {r.id: RequestRecord(r.id, r.arrival_s, r.prompt_len, r.max_new_tokens)
            for r in reqs}
    # Graded by each request's own SLOs where it states them, as the scheduler plans.
    slos = {r.id: (ttft_slo_s if r.ttft_slo_s is None else r.ttft_slo_s,
                   tbt_slo_s if r.tbt_slo_s is None else r.tbt_slo_s) for r in reqs}
    runs = [InstanceRun(s, e, recs, slos, tbt_slo_s, on_plan) for s, e in instances]
    for req in reqs:
        for run in runs:
            run.run_until(req.arrival_s, max_iterations)
        k = 0 if router is None else router.pick(
            [run.scheduler.load_report(req) for run in runs])
        recs[req.id].instance = k
        runs[k].add(req)
    for run in runs:
        run.run_until(float("inf"), max_iterations)
    scheds = [run.scheduler for run in runs]
    return SimReport(records=list(recs.values()),
                     iterations=sum(run.iterations for run in runs),
                     sim_seconds=max(run.executor.now() for run in runs),
                     busy_seconds=sum(run.executor.busy_s for run in runs),
                     preemptions=sum(s.num_preemptions for s in scheds),
                     slo_claim_violations=sum(run.claim_violations for run in runs),
                     prefix_queries=sum(s.prefix_queries for s in scheds),
                     prefix_hits=sum(s.prefix_hits for s in scheds))
