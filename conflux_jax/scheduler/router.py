"""Global router across XP instances (§6, Fig. 9 ①): lowest queued work over capacity."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from conflux_jax.scheduler.request import Request


class _Instance(Protocol):
    n: int

    def queued_work(self) -> int: ...


class Router:
    """Sends each new request to the instance with the lowest normalised queued work.

    Queued work is the remaining prefill tokens waiting on an instance; capacity
    defaults to its number of logical ranks (pass measured tokens/s to weight
    heterogeneous instances). Ties go to the lower index.
    """

    def __init__(self, instances: Sequence[_Instance],
                 capacities: Sequence[float] | None = None) -> None:
        if not instances:
            raise ValueError("router needs at least one instance")
        caps = [float(i.n) for i in instances] if capacities is None else list(capacities)
        if len(caps) != len(instances) or min(caps) <= 0:
            raise ValueError("one positive capacity per instance")
        self.instances = list(instances)
        self.capacities = caps

    def pick(self, req: Request | None = None) -> int:
        loads = [inst.queued_work() / cap
                 for inst, cap in zip(self.instances, self.capacities, strict=True)]
        return min(range(len(loads)), key=loads.__getitem__)
