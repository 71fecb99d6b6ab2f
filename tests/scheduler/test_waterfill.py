"""Waterfill dispatch (Alg. 2) against brute force on small random instances."""

import itertools
import random

import pytest

from conflux_jax.latency import Affine, LatencyModel
from conflux_jax.scheduler.waterfill import Dispatcher, capacity_at, waterfill_assign


def _model(n: int, comm_slope: float) -> LatencyModel:
    return LatencyModel(num_layers=2, num_ranks=n, gemm=Affine(1.0, 2.0), dec=Affine(0.01, 1.0),
                        pre=Affine(0.02, 0.5), comm=Affine(comm_slope, 0.3), alpha=1.3, beta=1.2)


def _est(model: LatencyModel, loads, n_p, a_p, t_d, add, extra):
    g = max(x + a for x, a in zip(loads, add, strict=True))
    c = max(x + a for x, a in zip(n_p, add, strict=True))
    return model.iteration(g, c, a_p + extra, t_d)


def _instance(rng: random.Random):
    n = rng.randint(2, 3)
    model = _model(n, comm_slope=0.0)
    decodes = [rng.randint(0, 6) for _ in range(n)]
    t_d = model.decode_path(rng.randint(0, 300))
    tau = rng.uniform(20, 70)
    return n, model, decodes, t_d, tau


@pytest.mark.parametrize("seed", range(60))
def test_budget_equals_best_assignment(seed: int) -> None:
    rng = random.Random(seed)
    n, model, decodes, t_d, tau = _instance(rng)
    max_level = 14
    disp = Dispatcher(model, tau, decodes, t_d, quantum=1, max_level=max_level)
    b0, level = disp.budget()
    best = 0
    for add in itertools.product(*(range(max(0, max_level - d) + 1) for d in decodes)):
        if _est(model, decodes, [0] * n, 0.0, t_d, add, 0.0) <= tau:
            best = max(best, sum(add))
    assert b0 == best
    assert capacity_at(decodes, level) == b0
    if b0:
        assert _est(model, decodes, [0] * n, 0.0, t_d,
                    [max(0, level - d) for d in decodes], 0.0) <= tau


@pytest.mark.parametrize("seed", range(60))
@pytest.mark.parametrize("quantum", [1, 4])
def test_chunk_equals_best_assignment(seed: int, quantum: int) -> None:
    rng = random.Random(seed)
    n, model, decodes, t_d, tau = _instance(rng)
    max_level = 14
    disp = Dispatcher(model, tau, decodes, t_d, quantum=quantum, max_level=max_level)
    prior = rng.randint(0, 4)  # a chunk already dispatched this iteration
    if prior:
        disp.commit(waterfill_assign(disp.loads, prior), c=0)
    loads, n_p, a_p = list(disp.loads), list(disp.n_p), disp.a_p
    m, c = rng.randint(1, 25), rng.randint(0, 30)
    length, add = disp.dispatch(m, c)
    best = 0
    for cand in itertools.product(*(range(max(0, max_level - x) + 1) for x in loads)):
        s = sum(cand)
        if s <= m and _est(model, loads, n_p, a_p, t_d, cand, s * (c + (s + 1) / 2)) <= tau:
            best = max(best, s)
    if _est(model, loads, n_p, a_p, t_d, [0] * n, 0.0) > tau:
        best = 0
    assert length == best
    assert sum(add) == length
    if length:
        assert _est(model, loads, n_p, a_p, t_d, add, length * (c + (length + 1) / 2)) <= tau
        assert max(x + a for x, a in zip(loads, add, strict=True)) <= max_level


@pytest.mark.parametrize("seed", range(40))
def test_level_is_largest_feasible_aligned_level_with_comm(seed: int) -> None:
    """With a sloped all-to-all term the level search is still exact over levels."""
    rng = random.Random(seed)
    n = rng.randint(2, 4)
    model = _model(n, comm_slope=0.4)
    decodes = [rng.randint(0, 20) for _ in range(n)]
    t_d = model.decode_path(rng.randint(0, 500))
    tau, q, max_level = rng.uniform(30, 120), rng.choice([1, 4, 8]), 64
    disp = Dispatcher(model, tau, decodes, t_d, quantum=q, max_level=max_level)
    b0, level = disp.budget()

    def fits(lv: int) -> bool:
        add = [max(0, lv - d) for d in decodes]
        return _est(model, decodes, [0] * n, 0.0, t_d, add, 0.0) <= tau

    feasible = [lv for lv in range(0, max_level + 1, q) if fits(lv)]
    want = max(feasible) if feasible and _est(model, decodes, [0] * n, 0, t_d, [0] * n, 0) <= tau \
        else None
    if want is None or capacity_at(decodes, want) == 0:
        assert b0 == 0
    else:
        assert level == want and b0 == capacity_at(decodes, want)


@pytest.mark.parametrize("seed", range(100))
def test_waterfill_assign_minimises_max_load(seed: int) -> None:
    rng = random.Random(seed)
    loads = [rng.randint(0, 10) for _ in range(rng.randint(1, 4))]
    amount = rng.randint(0, 20)
    add = waterfill_assign(loads, amount)
    assert sum(add) == amount and min(add) >= 0
    got = max(x + a for x, a in zip(loads, add, strict=True))
    best = min(max(x + a for x, a in zip(loads, cand, strict=True))
               for cand in itertools.product(range(amount + 1), repeat=len(loads))
               if sum(cand) == amount)
    assert got == best
    # monotone: one more token never takes tokens away from a rank
    more = waterfill_assign(loads, amount + 1)
    assert all(b >= a for a, b in zip(add, more, strict=True))


def test_decode_light_ranks_get_more_prefill() -> None:
    """Paper Fig. 15(a): a decode-heavy rank gets fewer prefill tokens."""
    model = _model(4, comm_slope=0.0)
    disp = Dispatcher(model, 1e9, [128, 0, 0, 0], 0.0, quantum=16, max_level=8192)
    length, add = disp.dispatch(1024, 0)
    assert length == 1024
    assert add[0] < add[1] == add[2] == add[3]
    assert max(x + a for x, a in zip([128, 0, 0, 0], add, strict=True)) == 288
