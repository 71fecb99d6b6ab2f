"""SLO compliance and goodput (paper §8.1): one definition for the simulator and the benches.

A request complies iff its i-th output token (0-based) arrives by
``arrival + TTFT_SLO + i * TBT_SLO``. Goodput is the highest arrival rate at which at
least ``ATTAINMENT_TARGET`` of the requests comply.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

ATTAINMENT_TARGET = 0.95
_EPS = 1e-9  # float noise: a token exactly on its deadline is on time


def token_deadline(arrival_s: float, index: int, ttft_slo_s: float, tbt_slo_s: float) -> float:
    """When output token ``index`` (0-based) is due."""
    return arrival_s + ttft_slo_s + index * tbt_slo_s


def on_time(t: float, arrival_s: float, index: int, ttft_slo_s: float,
            tbt_slo_s: float) -> bool:
    """Did output token ``index``, produced at ``t``, meet its deadline?"""
    return t <= token_deadline(arrival_s, index, ttft_slo_s, tbt_slo_s) + _EPS


def all_on_time(token_times: Iterable[float], arrival_s: float, ttft_slo_s: float,
                tbt_slo_s: float) -> bool:
    """Did every output token (in order) meet its deadline?"""
    return all(on_time(t, arrival_s, i, ttft_slo_s, tbt_slo_s)
               for i, t in enumerate(token_times))


def goodput(rates: Sequence[float], attainments: Sequence[float],
            target: float = ATTAINMENT_TARGET) -> float:
    """Highest of ``rates`` whose attainment meets ``target`` (0 if none)."""
    ok = [r for r, a in zip(rates, attainments, strict=True) if a >= target]
    return max(ok) if ok else 0.0
