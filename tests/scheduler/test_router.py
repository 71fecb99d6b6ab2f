"""Global router: each policy's choice from the instances' load reports, and the
scheduler's report itself (cached prefix, predicted TTFT against the simulated one)."""

import pytest

from conflux_jax.engine.core import EngineCore
from conflux_jax.latency import Affine, LatencyModel
from conflux_jax.plan import KVSpec
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.router import InstanceLoad, Router
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim import SimExecutor, simulate

MODEL = LatencyModel(num_layers=2, num_ranks=2, gemm=Affine(1e-5, 2e-3), dec=Affine(1e-6, 1e-4),
                     pre=Affine(1e-8, 0.0), comm=Affine(0.0, 0.0))


def _load(ranks: int = 2, queued: int = 0, cached: int = 0, ttft: float = 0.0) -> InstanceLoad:
    return InstanceLoad(num_ranks=ranks, queued_tokens=queued, decodes=0, cached_tokens=cached,
                        predicted_ttft_s=ttft)


def test_conflux_picks_the_lowest_predicted_ttft_then_the_longest_cached_prefix() -> None:
    r = Router("conflux")
    assert r.pick([_load(ttft=0.3), _load(ttft=0.1), _load(ttft=0.2)]) == 1
    assert r.pick([_load(ttft=0.1), _load(ttft=0.1, cached=64)]) == 1
    assert r.pick([None, _load(ttft=9.0), _load(ttft=1.0)]) == 2


def test_least_loaded_is_queued_work_over_capacity() -> None:
    r = Router("least-loaded")
    assert r.pick([_load(4, 4000), _load(2, 1000), _load(4, 3000)]) == 1  # 500 < 750 < 1000
    assert r.pick([_load(4, 4000), _load(2, 3000), _load(4, 3000)]) == 2  # 750 < 1000 < 1500
    # predicted TTFT and cache do not matter to it
    assert r.pick([_load(2, 10, ttft=5.0), _load(2, 20, cached=999, ttft=0.0)]) == 0
    weighted = Router("least-loaded", capacities=[1.0, 3.0])
    assert weighted.pick([_load(2, 100), _load(2, 200)]) == 1
    with pytest.raises(ValueError, match="capacities"):
        weighted.pick([_load(), _load(), _load()])


def test_round_robin_cycles_over_live_instances() -> None:
    r = Router("round-robin")
    assert [r.pick([_load(), _load(), _load()]) for _ in range(4)] == [0, 1, 2, 0]
    assert r.pick([None, _load(), _load()]) in (1, 2)


def test_bad_policy_capacity_and_no_live_instance_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown router policy 'random'"):
        Router("random")
    with pytest.raises(ValueError, match="positive"):
        Router("least-loaded", capacities=[0.0])
    with pytest.raises(RuntimeError, match="no live instance"):
        Router().pick([None, None])


def _sched(caching: bool = True) -> Scheduler:
    cfg = SchedulerConfig(tbt_slo_s=0.05, ttft_slo_s=10.0, enable_prefix_caching=caching)
    return Scheduler(cfg, MODEL, BlockManager(2, 400, 16))


def test_report_counts_the_cached_prefix_and_the_running_prefill_about_to_name_it() -> None:
    sched, ex = _sched(), SimExecutor(MODEL, KVSpec(2, 400, 16))
    prompt = tuple(range(1, 101))
    first = Request(0, 0.0, 100, 2, prompt_token_ids=prompt)
    again = Request(1, 0.0, 100, 2, prompt_token_ids=prompt[:80] + (7,) * 20)
    assert sched.cached_prefix_tokens(again) == 0
    sched.add(first)
    plan = sched.schedule(0.0)  # first's prefill starts: its pages are claimed
    assert sched.cached_prefix_tokens(again) == 80  # 5 full pages shared, in flight
    sched.commit(plan, ex.execute(plan))
    # Done prefilling: the same pages, now in the cache; the report only looks.
    assert sched.load_report(again).cached_tokens == 80
    assert sched.cached_prefix_tokens(again) == 80
    assert _sched(caching=False).cached_prefix_tokens(again) == 0
    salted = Request(2, 0.0, 100, 2, prompt_token_ids=again.prompt_token_ids, cache_salt="t")
    assert sched.cached_prefix_tokens(salted) == 0


@pytest.mark.parametrize("queued", [0, 1, 4])
def test_predicted_ttft_tracks_the_simulated_one(queued: int) -> None:
    """With the truth as the estimate, the report's TTFT of a request arriving behind
    ``queued`` 2000-token prompts and 40 resident decodes is within 15% of the TTFT the
    simulation then gives it (arrival order: the report prices the whole queue first)."""
    cfg = SchedulerConfig(tbt_slo_s=0.05, ttft_slo_s=10.0, order="fcfs")
    decodes = [Request(i, 0.0, 64, 400) for i in range(40)]
    sched = Scheduler(cfg, MODEL, BlockManager(2, 400, 16))
    ex = SimExecutor(MODEL, KVSpec(2, 400, 16))
    core = EngineCore(sched, ex)
    for r in decodes:
        core.add(r)
    while sched.num_decoding < 40:
        core.step()
    t1 = ex.now()
    backlog = [Request(100 + i, t1, 2000, 2) for i in range(queued)]
    probe = Request(999, t1, 1500, 2)
    for r in backlog:
        core.add(r)
    predicted = sched.load_report(probe).predicted_ttft_s
    truth = simulate(decodes + backlog + [probe], Scheduler(cfg, MODEL, BlockManager(2, 400, 16)),
                     SimExecutor(MODEL, KVSpec(2, 400, 16)), 10.0, 0.05)
    rec = next(r for r in truth.records if r.id == probe.id)
    assert predicted == pytest.approx(rec.first_token_s - t1, rel=0.15)


def test_an_idle_instance_reports_less_than_one_with_a_resident_decode() -> None:
    """The new prompt's TTFT is at least the whole iteration carrying it, decodes included:
    only the marginal prefill cost once made a busy instance look 100x faster than an idle
    one, and a burst all went to whichever instance took its first request."""
    idle, busy = _sched(), _sched()
    core = EngineCore(busy, SimExecutor(MODEL, KVSpec(2, 400, 16)))
    core.add(Request(0, 0.0, 4, 4, prompt_token_ids=(1, 2, 3, 4)))
    core.step()
    assert busy.num_decoding == 1
    probe = Request(9, 0.0, 4, 4, prompt_token_ids=(5, 6, 7, 8))
    loads = [busy.load_report(probe), idle.load_report(probe)]
    assert loads[0].predicted_ttft_s > loads[1].predicted_ttft_s
    assert loads[0].predicted_ttft_s >= MODEL.iteration(2, 2, 0.0, 0.0)
    assert Router("conflux").pick(loads) == 1
