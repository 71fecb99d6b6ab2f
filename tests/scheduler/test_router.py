"""Global router: lowest queued work over capacity."""

import pytest

from conflux_jax.scheduler.router import Router


class _Inst:
    def __init__(self, n: int, work: int) -> None:
        self.n = n
        self.work = work

    def queued_work(self) -> int:
        return self.work


def test_picks_lowest_normalised_work() -> None:
    r = Router([_Inst(4, 4000), _Inst(2, 1000), _Inst(4, 3000)])
    assert r.pick() == 1  # 1000/2 = 500 < 750 < 1000
    r.instances[1].work = 3000
    assert r.pick() == 2  # 3000/4 = 750 < 1000 < 1500


def test_explicit_capacities_and_ties() -> None:
    r = Router([_Inst(4, 100), _Inst(4, 100)], capacities=[1.0, 1.0])
    assert r.pick() == 0
    with pytest.raises(ValueError):
        Router([_Inst(1, 0)], capacities=[0.0])
    with pytest.raises(ValueError):
        Router([])
