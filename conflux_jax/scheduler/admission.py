"""Moore–Hodgson TTFT admission (§6.4, Appendix G, Alg. 4).

Jobs are pending prefills with remaining work ``m_i`` (tokens) and TTFT deadline
``d_i``. Under the fixed-capacity surrogate the prefill capacity available before
``d_i`` is ``K_i = max(0, floor((d_i - t) / tau)) * B0``. Scanning in EDF order and
evicting the largest admitted job whenever the cumulative work exceeds ``K_i`` admits
the maximum number of jobs that all meet their capacity (Moore, 1968). Admitted jobs
keep EDF order; rejected ones are returned in SJF order for backfill.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import TypeVar

K = TypeVar("K")


def moore_hodgson(jobs: Sequence[tuple[float, int, K]], b0: int, t: float,
                  tau: float) -> tuple[list[K], list[K]]:
    """``jobs`` are (deadline, remaining, key); returns (admitted EDF, rejected SJF)."""
    order = sorted(range(len(jobs)), key=lambda j: (jobs[j][0], j))
    heap: list[tuple[int, int]] = []  # (-remaining, -index): pops the largest, latest
    rejected: list[int] = []
    total = 0
    for j in order:
        d, m, _ = jobs[j]
        total += m
        heapq.heappush(heap, (-m, -j))
        cap = max(0, math.floor((d - t) / tau)) * b0
        if total > cap:
            neg_m, neg_j = heapq.heappop(heap)
            total += neg_m
            rejected.append(-neg_j)
    rej = set(rejected)
    admitted = [jobs[j][2] for j in order if j not in rej]
    rejected.sort(key=lambda j: (jobs[j][1], jobs[j][0], j))
    return admitted, [jobs[j][2] for j in rejected]
