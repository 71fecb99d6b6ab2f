"""Dual-mode decode placement (Alg. 3): worst-fit below eta, best-fit above, infeasible."""

import random

import pytest

from conflux_jax.scheduler.placement import place_decode


def test_worst_fit_picks_least_decode_context() -> None:
    # all ranks below eta: least aggregate context wins even if it has fewer free pages
    assert place_decode(10, [100, 80, 90], 200, [500, 100, 300], eta=0.9) == 1


def test_best_fit_once_all_ranks_above_threshold() -> None:
    # utilisations 0.95, 0.92, 0.97: all above eta -> fullest rank that still fits
    assert place_decode(5, [10, 16, 6], 200, [1, 2, 3], eta=0.9) == 2
    assert place_decode(7, [10, 16, 6], 200, [1, 2, 3], eta=0.9) == 0


def test_worst_fit_only_among_low_ranks() -> None:
    # rank 0 is above eta (least context but excluded), rank 1 below -> rank 1
    assert place_decode(5, [10, 100], 200, [0, 999], eta=0.9) == 1


def test_headroom_and_infeasible() -> None:
    assert place_decode(10, [12, 11], 100, [0, 0], eta=0.9, headroom_pages=2) == 0
    assert place_decode(10, [11, 11], 100, [0, 0], eta=0.9, headroom_pages=2) is None
    assert place_decode(10, [9, 5], 100, [0, 0], eta=0.9) is None


@pytest.mark.parametrize("seed", range(200))
def test_rules_against_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n, pages = rng.randint(1, 6), 50
    free = [rng.randint(0, pages) for _ in range(n)]
    ctx = [rng.randint(0, 5) for _ in range(n)]
    need, head, eta = rng.randint(1, 20), rng.randint(0, 3), rng.choice([0.3, 0.6, 0.9])
    got = place_decode(need, free, pages, ctx, eta, head)
    feasible = [r for r in range(n) if free[r] >= need + head]
    if not feasible:
        assert got is None
        return
    low = [r for r in feasible if (pages - free[r]) / pages < eta]
    if low:
        want = min(low, key=lambda r: (ctx[r], -free[r], r))
    else:
        want = min(feasible, key=lambda r: (free[r], r))
    assert got == want
