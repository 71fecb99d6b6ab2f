"""Moore–Hodgson admission (Alg. 4) against brute force over all subsets."""

import itertools
import math
import random

import pytest

from conflux_jax.scheduler.admission import moore_hodgson


def _on_time(subset, jobs, b0, t, tau) -> bool:
    total = 0
    for j in sorted(subset, key=lambda j: (jobs[j][0], j)):
        total += jobs[j][1]
        if total > max(0, math.floor((jobs[j][0] - t) / tau)) * b0:
            return False
    return True


@pytest.mark.parametrize("seed", range(150))
def test_admits_maximum_number_of_on_time_jobs(seed: int) -> None:
    rng = random.Random(seed)
    t, tau, b0 = rng.uniform(0, 5), 0.1, rng.randint(1, 50)
    jobs = [(t + rng.uniform(-0.2, 1.5), rng.randint(1, 200), k) for k in range(rng.randint(0, 9))]
    adm, rej = moore_hodgson(jobs, b0, t, tau)
    assert sorted(adm + rej) == list(range(len(jobs)))
    best = max((len(s) for size in range(len(jobs) + 1)
                for s in itertools.combinations(range(len(jobs)), size)
                if _on_time(s, jobs, b0, t, tau)), default=0)
    assert len(adm) == best
    assert _on_time(adm, jobs, b0, t, tau)
    assert [jobs[k][0] for k in adm] == sorted(jobs[k][0] for k in adm)  # EDF order
    assert [jobs[k][1] for k in rej] == sorted(jobs[k][1] for k in rej)  # SJF order


def test_past_deadlines_are_rejected() -> None:
    adm, rej = moore_hodgson([(0.5, 10, "late"), (9.0, 10, "ok")], b0=100, t=1.0, tau=0.1)
    assert adm == ["ok"] and rej == ["late"]
