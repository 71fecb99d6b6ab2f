"""Global router across XP instances (§6, Fig. 9 ①).

Each instance reports an :class:`InstanceLoad` for the arriving request
(:meth:`~conflux_jax.scheduler.scheduler.Scheduler.load_report`): its queued prefill work,
its resident decodes, how much of this prompt its prefix cache holds, and the TTFT its own
latency model predicts for the request. The router only compares reports, so the same
code routes simulated instances and Ray Serve replicas.

Policies:

- ``conflux``: lowest predicted TTFT. Prefix affinity is priced, not weighted: an
  instance caching the prompt's prefix predicts a shorter prefill for it, and one whose
  decodes leave less of each TBT-bounded iteration to prefill predicts a longer one.
- ``least-loaded``: the paper's rule, lowest queued work over capacity (ranks by default).
- ``round-robin``: the baseline that ignores load.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

ROUTER_POLICIES = ("conflux", "least-loaded", "round-robin")


@dataclasses.dataclass(frozen=True)
class InstanceLoad:
    """One instance's state as the router sees it, for one arriving request."""

    num_ranks: int
    queued_tokens: int  # uncached prefill tokens waiting or mid-prefill
    decodes: int  # resident decode requests
    cached_tokens: int  # of this request's prompt, held by the instance's prefix cache
    predicted_ttft_s: float  # queue drain plus this request's uncached prefill


class Router:
    """Chooses an instance per request from the instances' :class:`InstanceLoad` reports.

    ``capacities`` weight ``least-loaded`` (default: each instance's ranks). An instance
    whose report is ``None`` (unreachable or failed) is never chosen. Ties rotate, so
    idle instances share arrivals (and their caches the prefixes) instead of the first
    taking all.
    """

    def __init__(self, policy: str = "conflux",
                 capacities: Sequence[float] | None = None) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"unknown router policy {policy!r}; choose from "
                             f"{', '.join(ROUTER_POLICIES)}")
        if capacities is not None and min(capacities, default=1.0) <= 0:
            raise ValueError("router capacities must be positive")
        self.policy = policy
        self.capacities = None if capacities is None else [float(c) for c in capacities]
        self._turn = itertools.count()

    def pick(self, loads: Sequence[InstanceLoad | None]) -> int:
        """Index of the instance that gets the request."""
        live = [i for i, load in enumerate(loads) if load is not None]
        if not live:
            raise RuntimeError("no live instance to route to")
        turn = next(self._turn)
        if self.policy == "round-robin":
            return live[turn % len(live)]
        if self.capacities is not None and len(self.capacities) != len(loads):
            raise ValueError(f"{len(self.capacities)} capacities for {len(loads)} instances")

        def key(i: int) -> tuple[float, ...]:
            load = loads[i]
            assert load is not None
            if self.policy == "conflux":
                return (load.predicted_ttft_s, -load.cached_tokens, load.queued_tokens,
                        load.decodes, (i - turn) % len(loads))
            cap = load.num_ranks if self.capacities is None else self.capacities[i]
            return (load.queued_tokens / cap, (i - turn) % len(loads))

        return min(live, key=key)
