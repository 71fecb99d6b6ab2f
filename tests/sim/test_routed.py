"""Several simulated instances behind the global router."""

import pytest

from conflux_jax.latency import Affine, LatencyModel
from conflux_jax.plan import KVSpec
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.router import Router
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim import SimExecutor, simulate
from conflux_jax.sim.driver import simulate_routed

MODEL = LatencyModel(num_layers=2, num_ranks=2, gemm=Affine(1e-5, 2e-3), dec=Affine(1e-6, 1e-4),
                     pre=Affine(1e-8, 0.0), comm=Affine(0.0, 0.0))
TTFT, TBT = 1.0, 0.05


def _instance(pages: int = 400) -> tuple[Scheduler, SimExecutor]:
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT)
    return Scheduler(cfg, MODEL, BlockManager(2, pages, 16)), SimExecutor(MODEL,
                                                                          KVSpec(2, pages, 16))


def _conversations(n: int, turns: int, gap_s: float = 0.5) -> list[Request]:
    """``n`` chats, each turn resending the whole history plus 32 new tokens."""
    reqs = []
    for c in range(n):
        history: tuple[int, ...] = tuple(range(1000 * c + 1, 1000 * c + 257))
        for t in range(turns):
            history = history + tuple(range(50_000 + 100 * t, 50_032 + 100 * t))
            reqs.append(Request(len(reqs), 0.05 * c + gap_s * t, len(history), 4,
                                prompt_token_ids=history))
    return reqs


def test_one_instance_behind_a_router_is_the_plain_simulation() -> None:
    reqs = _conversations(4, 3)
    plain = simulate(reqs, *_instance(), TTFT, TBT)
    routed = simulate_routed(reqs, [_instance()], Router("conflux"), TTFT, TBT)
    assert [(r.first_token_s, r.finish_s) for r in plain.records] == \
        [(r.first_token_s, r.finish_s) for r in routed.records]
    assert routed.iterations == plain.iterations


def test_conflux_router_keeps_a_conversation_on_the_instance_caching_it() -> None:
    reqs = _conversations(5, 4)  # odd: round-robin does not keep chats in place
    rep = simulate_routed(reqs, [_instance(), _instance()], Router("conflux"), TTFT, TBT)
    by_chat: dict[int, set[int]] = {}
    for r in rep.records:
        by_chat.setdefault(r.id // 4, set()).add(r.instance)
    assert all(len(s) == 1 for s in by_chat.values())  # every turn where its history is
    assert {r.instance for r in rep.records} == {0, 1}  # and the chats spread over both
    rr = simulate_routed(reqs, [_instance(), _instance()], Router("round-robin"), TTFT, TBT)
    assert rep.prefix_hit_rate > rr.prefix_hit_rate
    assert all(r.finish_s is not None for r in rep.records + rr.records)


@pytest.mark.parametrize("policy", ["conflux", "least-loaded"])
def test_load_aware_routers_spread_a_burst(policy: str) -> None:
    """Twelve distinct prompts at once: each load-aware router sends half to each."""
    reqs = [Request(i, 0.0, 1024, 4, prompt_token_ids=tuple(range(i * 2000 + 1,
                                                                  i * 2000 + 1025)))
            for i in range(12)]
    rep = simulate_routed(reqs, [_instance(), _instance()], Router(policy), TTFT, TBT)
    assert sorted(sum(r.instance == k for r in rep.records) for k in (0, 1)) == [6, 6]
    assert rep.sim_seconds < simulate(reqs, *_instance(), TTFT, TBT).sim_seconds


def test_several_instances_need_a_router() -> None:
    with pytest.raises(ValueError, match="router"):
        simulate_routed([], [_instance(), _instance()], None, TTFT, TBT)
