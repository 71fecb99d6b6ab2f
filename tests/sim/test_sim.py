"""Simulated executor: exact KV tracking, virtual clock, deadline compliance."""

import pytest

from conflux_jax.latency import Affine, BatchShape, LatencyModel
from conflux_jax.plan import DecodeSlot, Executor, IterationPlan, KVSpec, PrefillPiece
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim import SimExecutor, simulate

MODEL = LatencyModel(num_layers=1, num_ranks=2, gemm=Affine(0.001, 0.01), dec=Affine(1e-5, 0.0),
                     pre=Affine(1e-6, 0.0), comm=Affine(0.0, 0.0))


def test_is_an_executor_and_prices_exact_kv_from_the_plan() -> None:
    ex = SimExecutor(MODEL, KVSpec(2, 10, 16))
    assert isinstance(ex, Executor) and ex.num_ranks == 2
    p1 = IterationPlan((PrefillPiece(1, 0, (3, 2), False, None),), (), 0.0)
    r1 = ex.execute(p1)
    assert dict(r1.tokens) == {}  # no completing chunk: nothing sampled
    p2 = IterationPlan((PrefillPiece(1, 5, (1, 1), True, 1),), (), 0.0)
    r2 = ex.execute(p2)
    assert dict(r2.tokens) == {1: 0}
    # prefill work l*(c + (l+1)/2) of a 2-token chunk after 5 cached tokens
    assert r2.latency_s == pytest.approx(MODEL.estimate(BatchShape((1, 1), (0, 0), (0, 0),
                                                                   2 * (5 + 1.5))))
    p3 = IterationPlan((), (DecodeSlot(1, 1, position=7),), 0.0)
    r3 = ex.execute(p3)
    # decode at KV length 7 attends to 8 tokens on rank 1
    want = MODEL.estimate(BatchShape((0, 0), (0, 1), (0, 8), 0.0))
    assert r3.latency_s == pytest.approx(want) and dict(r3.tokens) == {1: 0}
    assert r3.end_s == pytest.approx(r1.latency_s + r2.latency_s + r3.latency_s)
    assert ex.now() == pytest.approx(r3.end_s)


def test_idle_gaps_are_skipped_and_compliance_is_per_token() -> None:
    cfg = SchedulerConfig(tbt_slo_s=0.05, ttft_slo_s=0.5)
    sched = Scheduler(cfg, MODEL, BlockManager(2, 100, 16))
    ex = SimExecutor(MODEL, KVSpec(2, 100, 16))
    reqs = [Request(0, 0.0, 10, 3), Request(1, 100.0, 10, 3)]
    rep = simulate(reqs, sched, ex, ttft_slo_s=0.5, tbt_slo_s=0.05)
    assert rep.iterations == 6  # 1 prefill + 2 decodes per request, no idle iterations
    assert all(r.compliant and r.tokens == 3 for r in rep.records)
    assert rep.records[1].first_token_s == pytest.approx(100.0 + ex.model.estimate(
        BatchShape((5, 5), (0, 0), (0, 0), 10 * 5.5)))
    assert rep.attainment == 1.0


def test_late_token_breaks_compliance() -> None:
    slow = LatencyModel(num_layers=1, num_ranks=1, gemm=Affine(0.0, 0.2), dec=Affine(),
                        pre=Affine(), comm=Affine())
    cfg = SchedulerConfig(tbt_slo_s=0.1, ttft_slo_s=1.0)
    sched = Scheduler(cfg, slow, BlockManager(1, 100, 16))
    ex = SimExecutor(slow, KVSpec(1, 100, 16))
    # token i due at 1.0 + (i-1)*0.1; produced at 0.2*i: 5 tokens fine, the 10th is not
    rep = simulate([Request(0, 0.0, 4, 5), Request(1, 10.0, 4, 10)], sched, ex, 1.0, 0.1)
    assert [r.compliant for r in rep.records] == [True, False]
    assert rep.attainment == 0.5
