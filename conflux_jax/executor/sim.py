"""Simulated executor: the latency model as the clock (DESIGN.md §2).

:class:`SimExecutor` implements the :class:`~conflux_jax.executor.base.Executor`
protocol. It keeps the exact KV length of every request it has seen (from the plans'
prefill pieces and decode slots, not batch means), prices each plan with a
:class:`LatencyModel` and advances a virtual clock. :func:`simulate` is the
discrete-event driver: it feeds arrivals to a scheduler, runs plans back to back and
jumps the clock over idle gaps, recording per-token deadline compliance (§8.1).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Protocol

from conflux_jax.executor.base import IterationPlan, KVSpec, StepResult
from conflux_jax.scheduler.latency import BatchShape, LatencyModel


class SimExecutor:
    """Virtual-clock executor. ``noise`` adds a seeded relative jitter to each step."""

    def __init__(self, model: LatencyModel, kv: KVSpec, start_s: float = 0.0,
                 noise: float = 0.0, seed: int = 0) -> None:
        if model.num_ranks != kv.num_ranks:
            raise ValueError("latency model and KV spec disagree on the number of ranks")
        self.model = model
        self._kv_spec = kv
        self.now = start_s
        self.noise = noise
        self._rng = random.Random(seed)
        self.kv_lens: dict[int, int] = {}
        self.iterations = 0
        self.busy_s = 0.0

    @property
    def num_ranks(self) -> int:
        return self._kv_spec.num_ranks

    @property
    def kv(self) -> KVSpec:
        return self._kv_spec

    def advance_to(self, t: float) -> None:
        """Idle until ``t`` (no-op if the clock is already past it)."""
        if t > self.now:
            self.now = t

    def price(self, plan: IterationPlan) -> float:
        """Latency of ``plan`` from the exact per-request KV lengths."""
        return self.model.estimate(BatchShape.from_plan(plan, self.kv_lens, self.num_ranks))

    def execute(self, plan: IterationPlan) -> StepResult:
        kv = self.kv_lens
        for rid in plan.released:
            kv.pop(rid, None)
        latency = self.price(plan)
        if self.noise:
            latency *= max(0.0, 1.0 + self._rng.gauss(0.0, self.noise))
        tokens: dict[int, int] = {}
        for p in plan.prefill:
            kv[p.request_id] = p.start + p.length
            if p.completes:
                tokens[p.request_id] = 0
        for d in plan.decode:
            kv[d.request_id] += 1
            tokens[d.request_id] = 0
        self.now += latency
        self.busy_s += latency
        self.iterations += 1
        return StepResult(tokens=tokens, latency_s=latency, end_s=self.now)


class _Sched(Protocol):
    @property
    def has_work(self) -> bool: ...

    def add(self, req) -> bool: ...  # noqa: ANN001

    def schedule(self, now: float) -> IterationPlan: ...

    def commit(self, plan: IterationPlan, result: StepResult | None = None) -> list[int]: ...


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


@dataclasses.dataclass
class SimReport:
    records: list[RequestRecord]
    iterations: int
    sim_seconds: float
    busy_seconds: float
    preemptions: int
    slo_claim_violations: int  # plans claiming to fit whose priced latency exceeded TBT

    @property
    def attainment(self) -> float:
        """Fraction of requests whose every token met its deadline (aborted = late)."""
        if not self.records:
            return 1.0
        ok = sum(1 for r in self.records if r.compliant and not r.aborted
                 and r.finish_s is not None)
        return ok / len(self.records)


def simulate(requests: Sequence, scheduler: _Sched, executor: SimExecutor,  # noqa: ANN001
             ttft_slo_s: float, tbt_slo_s: float, max_iterations: int = 10_000_000,
             on_plan=None) -> SimReport:  # noqa: ANN001
    """Run ``requests`` (sorted by arrival) to completion; discrete-event virtual time.

    A request complies iff its i-th output token (1-based) is produced by
    ``arrival + TTFT_SLO + (i - 1) * TBT_SLO``. ``on_plan(plan, result)`` is an optional
    hook (tests use it to check invariants).
    """
    reqs = sorted(requests, key=lambda r: (r.arrival_s, r.id))
    recs = {r.id: RequestRecord(r.id, r.arrival_s, r.prompt_len, r.max_new_tokens)
            for r in reqs}
    i = 0
    iters = 0
    claim_violations = 0
    nreq = len(reqs)
    while i < nreq or scheduler.has_work:
        now = executor.now
        while i < nreq and reqs[i].arrival_s <= now:
            if not scheduler.add(reqs[i]):
                recs[reqs[i].id].aborted = True
            i += 1
        if not scheduler.has_work:
            if i < nreq:
                executor.advance_to(reqs[i].arrival_s)
                continue
            break
        plan = scheduler.schedule(now)
        if plan.empty:
            scheduler.commit(plan, None)
            if i < nreq:
                executor.advance_to(reqs[i].arrival_s)
                continue
            raise RuntimeError("scheduler stalled: work left but nothing schedulable")
        result = executor.execute(plan)
        if plan.fits_slo and result.latency_s > tbt_slo_s * (1 + 1e-9) and not executor.noise:
            claim_violations += 1
        end = result.end_s
        for rid in result.tokens:
            rec = recs[rid]
            rec.tokens += 1
            if rec.tokens == 1:
                rec.first_token_s = end
            if end > rec.arrival_s + ttft_slo_s + (rec.tokens - 1) * tbt_slo_s:
                rec.compliant = False
        for rid in scheduler.commit(plan, result):
            recs[rid].finish_s = end
        if on_plan is not None:
            on_plan(plan, result)
        iters += 1
        if iters >= max_iterations:
            raise RuntimeError(f"simulation exceeded {max_iterations} iterations")
    return SimReport(records=list(recs.values()), iterations=iters, sim_seconds=executor.now,
                     busy_seconds=executor.busy_s,
                     preemptions=getattr(scheduler, "num_preemptions", 0),
                     slo_claim_violations=claim_violations)
