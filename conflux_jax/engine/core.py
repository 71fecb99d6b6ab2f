"""The one driver loop: the scheduler plans, an executor runs the plan, the scheduler commits.

The serving engine runs it with the JAX executor on the wall clock; the simulator runs the
very same loop with the simulated executor on a virtual clock, so the code measured in
simulation is the code that serves.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import cast

from conflux_jax.plan import (
    BuildingExecutor,
    Executor,
    ExecutorLost,
    IterationPlan,
    KVLost,
    LaunchingExecutor,
    Preparer,
    RunningStep,
    StepResult,
)
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.scheduler import Scheduler

# Sees each executed plan's result before the scheduler commits it, so that requests the
# caller ends (EOS, stop strings) are dropped in the same commit.
Observer = Callable[[IterationPlan, StepResult], None]


class StepFailed(RuntimeError):
    """The executor raised on a plan; the plan's requests are named so that the caller
    can fail them (a failing step fails its requests, not the engine)."""

    def __init__(self, plan: IterationPlan, cause: BaseException,
                 ahead: IterationPlan | None = None) -> None:
        self.plan = plan
        self.ahead = ahead  # a plan made ahead that fails with it (it was never launched)
        super().__init__(f"step failed ({len(self.request_ids)} requests): {cause!r}")

    @property
    def request_ids(self) -> list[int]:
        """Every request to fail: the plan's, and those of the plan made ahead."""
        ids = self.plan.request_ids
        return ids if self.ahead is None else list(dict.fromkeys(ids + self.ahead.request_ids))


@dataclasses.dataclass(frozen=True)
class Done:
    """An iteration the executor ran to the end before returning."""

    done: StepResult

    def result(self) -> StepResult:
        return self.done


@dataclasses.dataclass(frozen=True)
class InFlight:
    """A planned iteration set running; :meth:`EngineCore.finish` waits and commits it.
    ``finished``: set once :meth:`EngineCore.advance` applied its progress (the requests
    its length limits end); its tokens are then all that is left to commit."""

    plan: IterationPlan
    running: RunningStep
    finished: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Iteration:
    """One executed iteration: its plan, what the executor produced, who finished."""

    plan: IterationPlan
    result: StepResult
    finished: tuple[int, ...]


class EngineCore:
    """Drives one scheduler and any :class:`~conflux_jax.plan.Executor`."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        if scheduler.n != executor.num_ranks:
            raise ValueError(f"scheduler has {scheduler.n} ranks, executor "
                             f"{executor.num_ranks}")
        self.scheduler = scheduler
        self.executor = executor

    def add(self, request: Request) -> bool:
        """Queue ``request``; False (nothing queued) if it can never fit the KV pools."""
        return self.scheduler.add(request)

    def abort(self, request_id: int) -> None:
        """Drop a request and free its KV pages."""
        self.scheduler.abort(request_id)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self, observe: Observer | None = None,
             prepare: Preparer | None = None) -> Iteration | None:
        """Plan, execute and commit one iteration; None when nothing could be scheduled.

        Raises :class:`StepFailed` when the executor raises (the plan is committed as not
        run, so the scheduler's KV bookkeeping stays whole) or ``observe`` does (committed
        as run). When the failure cost the
        executor its KV (:class:`~conflux_jax.plan.KVLost`), every request that held KV
        is first set to recompute from its tokens: the caller fails the plan's requests,
        and the others resume as if preempted. :class:`~conflux_jax.plan.ExecutorLost`
        (the instance itself is gone) passes through unwrapped: no request can resume.
        """
        flight = self.start(prepare, wait=True)
        return None if flight is None else self.finish(flight, observe)

    def start(self, prepare: Preparer | None = None, wait: bool = False,
              planned: IterationPlan | None = None) -> InFlight | None:
        """Plan one iteration and set it running on the executor (``launch``: the call
        returns while the device computes; with ``wait``, ``execute``: it returns done).
        None when nothing could be scheduled. Nothing else may be scheduled until
        :meth:`finish` commits it. ``planned``: the iteration :meth:`plan_ahead` made,
        started now. Raises as :meth:`step`."""
        plan = self._schedule() if planned is None else planned
        if plan is None:
            return None
        ex = self.executor
        with self._failing(plan):
            # The executor completes the plan (grammar masks) while its device runs it.
            if not wait:
                return InFlight(plan, cast(LaunchingExecutor, ex).launch(plan, prepare))
            return InFlight(plan, Done(ex.execute(plan) if prepare is None else
                                       ex.execute(plan, prepare)))

    def finish(self, flight: InFlight, observe: Observer | None = None,
               ahead: IterationPlan | None = None) -> Iteration:
        """Wait for a started iteration, show it to ``observe`` and commit it. Raises as
        :meth:`step`.

        For an advanced iteration only its tokens are left to record. ``ahead``: the
        iteration planned after it; should this one fail, that one is committed as not
        run and its requests fail too (:attr:`StepFailed.ahead`): its rows would be fed
        tokens that never came.
        """
        plan = flight.plan
        with self._failing(plan, ahead, committed=flight.finished is not None):
            result = flight.running.result()
        if observe is not None:
            try:
                observe(plan, result)
            except Exception as exc:
                # The step ran and its KV is written: commit it as run, then fail its
                # requests. Left uncommitted, every later schedule() would refuse to plan.
                self._commit(flight, result)
                raise StepFailed(plan, exc) from exc
        return Iteration(plan, result, self._commit(flight, result))

    def _commit(self, flight: InFlight, result: StepResult) -> tuple[int, ...]:
        if flight.finished is None:
            return tuple(self.scheduler.commit(flight.plan, result))
        self.scheduler.record(flight.plan, result)
        return flight.finished

    # ---- planning ahead: the next iteration made while the device runs this one ------
    def advance(self, flight: InFlight) -> InFlight:
        """Apply a running iteration's progress now, before its tokens are known, so
        that the next can be planned (:meth:`plan_ahead`); :meth:`finish` then records
        its tokens."""
        if flight.finished is not None:
            raise RuntimeError("this iteration was advanced already")
        return dataclasses.replace(
            flight, finished=tuple(self.scheduler.advance(flight.plan)))

    def plan_ahead(self) -> IterationPlan | None:
        """Plan the next iteration (the running one advanced) and have the executor build
        its step now, while the device computes; :meth:`start` it once the running one is
        finished. None when nothing could be scheduled. Raises as :meth:`step`."""
        plan = self._schedule()
        if plan is None:
            return None
        sched = self.scheduler
        with self._failing(plan):
            # Its decode slots take the running iteration's samples, recorded by then.
            cast(BuildingExecutor, self.executor).build(plan, lambda: sched.last_tokens(plan))
        return plan

    def launch_ahead(self, planned: IterationPlan, running: InFlight) -> InFlight | None:
        """Start a plan made by :meth:`plan_ahead` now, while ``running`` (advanced) still
        computes, its decode slots fed ``running``'s samples on the device; None when the
        executor cannot (``planned`` stays to :meth:`start`). Commit it with
        :meth:`finish` after ``running``; should ``running`` fail, pass it as that finish's
        ``ahead`` (it took ``running``'s tokens). Raises as :meth:`step`."""
        ex = cast(BuildingExecutor, self.executor)
        if not ex.feeds_ahead(planned, running.running):
            return None
        with self._failing(planned):
            return InFlight(planned, ex.launch(planned, after=running.running))

    def _schedule(self) -> IterationPlan | None:
        """The next plan, or None (committed at once) when it would run nothing."""
        plan = self.scheduler.schedule(self.executor.now())
        if plan.empty:
            self.scheduler.commit(plan, None)
            return None
        return plan

    def discard(self, planned: IterationPlan) -> None:
        """Drop a planned-ahead iteration unstarted (every request in it has ended)."""
        self.scheduler.advance(planned, ran=False)

    @contextlib.contextmanager
    def _failing(self, plan: IterationPlan, ahead: IterationPlan | None = None,
                 committed: bool = False) -> Iterator[None]:
        """An executor failure on ``plan``: commit it as not run (unless it was advanced
        already: ``committed``), and ``ahead`` with it, then raise (see step)."""
        sched = self.scheduler
        try:
            yield
        except Exception as exc:
            for pending in (None if committed else plan, ahead):
                if pending is not None:
                    sched.advance(pending, ran=False)
            if isinstance(exc, ExecutorLost):
                raise
            if isinstance(exc, KVLost):
                sched.recompute_all()
            raise StepFailed(plan, exc, ahead) from exc
