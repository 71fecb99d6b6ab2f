"""Bounded waiting: under SRPT a long late request starves behind a stream of short ones;
with the overdue rule it is served first once its grace has passed, within the stated bound
(a floor of ``overdue_min_chunk`` tokens every iteration)."""

import math

import pytest

from conflux_jax.latency import Affine, LatencyModel
from conflux_jax.plan import KVSpec
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim import SimExecutor, simulate

# One rank; an iteration costs 10 ms + 0.1 ms per token, so the 50 ms TBT SLO admits 400
# prefill tokens: exactly two 200-token prompts.
MODEL = LatencyModel(num_layers=1, num_ranks=1, gemm=Affine(1e-4, 0.01), dec=Affine(),
                     pre=Affine(), comm=Affine())
TTFT, TBT, GRACE, LONG = 1.0, 0.05, 1.0, 4000


def _run(grace: float) -> dict[int, float]:
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT, order="srpt", quantum=16,
                          max_tokens_per_rank=512, overdue_grace_s=grace)
    sched = Scheduler(cfg, MODEL, BlockManager(1, 20_000, 16))
    # Shorts arrive at 100/s for 5 s, served at 40/s: the queue always holds shorter work.
    reqs = [Request(0, 0.0, LONG, 1)] + [Request(i, 0.01 * i, 200, 1) for i in range(1, 501)]
    rep = simulate(reqs, sched, SimExecutor(MODEL, KVSpec(1, 20_000, 16)), TTFT, TBT)
    return {r.id: r.first_token_s for r in rep.records}


def test_srpt_alone_starves_the_long_request():
    first = _run(math.inf)
    assert first[0] > max(first[i] for i in range(1, 501)) - 0.1  # served after every short


def test_the_overdue_rule_serves_it_within_the_bound():
    first = _run(GRACE)
    overdue_at = 0.0 + TTFT + GRACE
    # Stated bound: from then on it gets >= overdue_min_chunk (16) tokens per iteration,
    # and an iteration costs at most 10 ms + 0.1 ms * 512 tokens.
    bound = overdue_at + math.ceil(LONG / 16) * (0.01 + 1e-4 * 512)
    assert overdue_at <= first[0] <= bound
    # Here it gets the whole TBT budget (400 tokens) as soon as it is overdue.
    assert first[0] == pytest.approx(overdue_at + 10 * TBT, abs=2 * TBT)
    # The shorts still all get served.
    assert all(first[i] is not None for i in range(1, 501))
