"""Dual-mode decode placement (§6.3, Appendix F, Alg. 3).

Feasible ranks can hold the request's full-head KV plus a headroom of ``headroom_pages``.
While some feasible rank is below KV utilisation ``eta``, pick among those the rank with
the smallest aggregate decode context (worst-fit: spreads decode attention, Eq. 5);
once every feasible rank is at or above ``eta``, pick the fullest rank that still fits
(best-fit: packs KV, keeps whole free pools for later placements). Ties go to the lower
rank index. ``None`` means infeasible: the completing chunk must not be admitted.
"""

from __future__ import annotations

from collections.abc import Sequence


def place_decode(need_pages: int, free_pages: Sequence[int], num_pages: int,
                 ctx_sums: Sequence[int], eta: float, headroom_pages: int = 0) -> int | None:
    """Alg. 3 over the tentative per-rank state (free pages and decode context sums)."""
    best: int | None = None
    low_best: int | None = None
    limit = need_pages + headroom_pages
    for r, free in enumerate(free_pages):
        if free < limit:
            continue
        below = (num_pages - free) < eta * num_pages
        if below and (low_best is None or ctx_sums[r] < ctx_sums[low_best] or (
                ctx_sums[r] == ctx_sums[low_best] and free > free_pages[low_best])):
            low_best = r
        if best is None or free < free_pages[best]:
            best = r
    return low_best if low_best is not None else best
