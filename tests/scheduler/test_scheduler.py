"""Scheduler invariants over long random simulated runs, for every policy."""

import random

import pytest

from conflux_jax.latency import BatchShape
from conflux_jax.latency.roofline import roofline_model
from conflux_jax.plan import KVSpec, SampledToken, StepResult
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim import SimExecutor, simulate

TBT, TTFT = 0.1, 2.0


def _requests(seed: int, count: int, rate: float, max_prompt: int = 6000,
              max_out: int = 120) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(count):
        t += rng.expovariate(rate)
        out.append(Request(i, t, rng.randint(1, max_prompt), rng.randint(1, max_out)))
    return out


class Checked:
    """Wraps a scheduler and checks the per-iteration invariants."""

    def __init__(self, sched: Scheduler, executor: SimExecutor) -> None:
        self.s = sched
        self.ex = executor
        self.iterations = 0
        self.mixed = 0
        self.kv: dict[int, int] = {}  # KV length of each request, tracked from the plans

    def __getattr__(self, name: str):  # everything not checked goes to the scheduler
        return getattr(self.s, name)

    def schedule(self, now: float):
        before = self.s.decode_ranks()
        plan = self.s.schedule(now)
        mode = self.s.cfg.mode
        ids = [d.request_id for d in plan.decode]
        assert len(ids) == len(set(ids))
        if plan.mode == "isolated_prefill":
            assert not plan.decode
        elif plan.mode == "isolated_decode":
            assert not plan.prefill
        if plan.mode != "isolated_prefill":
            # stall-free: every resident decode advances unless it was just preempted
            assert set(ids) == set(before) - set(plan.preempted)
        for d in plan.decode:
            assert before[d.request_id] == d.rank  # decodes never migrate
        assert set(plan.preempted) <= set(plan.released)
        for p in plan.prefill:
            assert len(p.counts) == self.s.n and min(p.counts) >= 0 and p.length > 0
            assert p.completes == (p.decode_rank is not None)
            st = self.s.state(p.request_id)
            assert st is not None and p.start == st.prefilled
            assert p.start + p.length <= st.target
            assert p.completes == (p.start + p.length == st.target)
            pt = self.s.blocks.page_table(p.request_id)
            assert pt.prefill is not None
            bm = self.s.blocks
            assert len(pt.prefill[0]) >= bm.prefill_pages_for(st.target)
            if p.completes:
                assert pt.decode_rank == p.decode_rank
                assert len(pt.decode) * bm.page_size >= st.target + 1
        for d in plan.decode:
            st = self.s.state(d.request_id)
            pt = self.s.blocks.page_table(d.request_id)
            assert len(pt.decode) * self.s.blocks.page_size >= st.kv_len + 1
        # decode slots carry the KV length the plans built up; the scheduler's incremental
        # estimate equals an independent pricing of the plan
        for rid in plan.released:
            self.kv.pop(rid, None)
        for d in plan.decode:
            assert d.position == self.kv[d.request_id]
            assert d.pages == self.s.blocks.page_table(d.request_id).decode
        priced = self.s.model.estimate(BatchShape.from_plan(plan, self.s.n)) \
            if not plan.empty else 0.0
        assert plan.estimated_latency_s == pytest.approx(priced, rel=1e-9, abs=1e-12)
        if mode == "conflux" and plan.prefill and not plan.fits_slo:
            # only the liveness fallback (idle instance, one quantum) or the bounded-wait
            # floor (the oldest overdue request, overdue_min_chunk) may exceed the SLO
            head = self.s.state(plan.prefill[0].request_id)
            grace = self.s.cfg.overdue_grace_s
            overdue = head.deadline_s < now - (self.s.cfg.ttft_slo_s if grace is None
                                               else grace)
            if overdue:
                assert plan.prefill[0].length <= self.s.cfg.overdue_min_chunk
            else:
                assert not plan.decode and len(plan.prefill) == 1
                assert plan.prefill[0].length <= self.s.cfg.quantum
        if mode == "conflux" and plan.prefill and plan.fits_slo:
            assert plan.estimated_latency_s <= TBT
            self.mixed += bool(plan.decode)
        self.iterations += 1
        return plan

    def commit(self, plan, result=None):
        for p in plan.prefill:
            self.kv[p.request_id] = p.start + p.length
        for d in plan.decode:
            self.kv[d.request_id] += 1
        finished = self.s.commit(plan, result)
        if self.s.blocks.num_pages <= 5000 or self.iterations % 200 == 0:
            self.s.blocks.check_consistency()  # O(pages): sampled on real-size pools
        return finished


POLICIES = [
    ("conflux", "slo", 4), ("conflux", "fcfs", 4), ("conflux", "srpt", 4),
    ("tp_chunked", "fcfs", 1), ("tp_chunked", "srpt", 1), ("isolated", "fcfs", 4),
    ("isolated", "slo", 4),
]


@pytest.mark.parametrize(("mode", "order", "n"), POLICIES)
@pytest.mark.parametrize("num_pages", [120, 2000])
def test_long_random_run_invariants(mode: str, order: str, n: int, num_pages: int) -> None:
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT, order=order, mode=mode,  # type: ignore[arg-type]
                          quantum=16, max_tokens_per_rank=4096, headroom_pages=1,
                          token_budget=1024)
    model = roofline_model("qwen3-14b", "h100", sp=n, tp=4 // n)
    bm = BlockManager(n, num_pages, 16)
    sched = Scheduler(cfg, model, bm)
    ex = SimExecutor(model, KVSpec(n, num_pages, 16))
    checked = Checked(sched, ex)
    small = num_pages == 120
    reqs = _requests(seed=num_pages + n, count=300, rate=8.0 if small else 6.0,
                     max_prompt=1000 if small else 6000, max_out=400 if small else 120)
    report = simulate(reqs, checked, ex, TTFT, TBT)
    assert checked.iterations > 100
    # every request finished or was refused (too long for one rank's pool)
    for rec in report.records:
        assert rec.aborted or (rec.finish_s is not None and rec.tokens == rec.output_len)
        assert rec.aborted == (not sched.fits(reqs[rec.id]))
    assert not sched.has_work
    assert all(bm.free_pages(r) == num_pages for r in range(n))
    assert report.slo_claim_violations == 0
    if num_pages == 120:
        assert report.preemptions > 0  # the small pool forces recompute preemption
    if mode == "conflux":
        assert checked.mixed > 0


def test_abort_mid_iteration_is_deferred() -> None:
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT)
    model = roofline_model("qwen3-14b", "h100", sp=2)
    bm = BlockManager(2, 100, 16)
    sched = Scheduler(cfg, model, bm)
    assert sched.add(Request(1, 0.0, 100, 5))
    plan = sched.schedule(0.0)
    assert plan.prefill and plan.prefill[0].completes
    sched.abort(1)
    assert 1 in bm  # the executor may still be reading its pages
    sched.commit(plan, None)
    assert 1 not in bm and not sched.has_work
    assert sched.schedule(0.1).released == (1,)


def test_too_long_request_is_refused() -> None:
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT)
    sched = Scheduler(cfg, roofline_model("qwen3-14b", "h100", sp=2), BlockManager(2, 10, 16))
    assert not sched.add(Request(1, 0.0, 200, 10))
    assert sched.add(Request(2, 0.0, 50, 10))


def test_slo_order_prefers_urgent_feasible_requests() -> None:
    """With a tight budget, EDF admission serves the request that can still make it."""
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT, order="slo")
    model = roofline_model("qwen3-14b", "h100", sp=4)
    sched = Scheduler(cfg, model, BlockManager(4, 5000, 16))
    sched.add(Request(1, 0.0, 20_000, 2))  # due at 2.0 s: 20K cannot fit in 0.1 s
    sched.add(Request(2, 1.0, 3_000, 2))  # due at 3.0 s: earlier in EDF only if feasible
    plan = sched.schedule(1.9)
    assert [p.request_id for p in plan.prefill] == [2, 1]  # 1 is SJF backfill


def test_fcfs_and_srpt_orders() -> None:
    model = roofline_model("qwen3-14b", "h100", sp=4)
    for order, first in (("fcfs", 1), ("srpt", 2)):
        cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT, order=order)  # type: ignore[arg-type]
        sched = Scheduler(cfg, model, BlockManager(4, 5000, 16))
        sched.add(Request(1, 0.0, 20_000, 2))
        sched.add(Request(2, 0.1, 3_000, 2))
        assert sched.schedule(0.2).prefill[0].request_id == first


@pytest.mark.parametrize("policy", ["MuxWise++", "ConfluxServe", "Chunked++", "LoongServe"])
def test_named_policies_keep_invariants_at_real_kv_sizes(policy: str) -> None:
    from conflux_jax.sim.policies import InstanceSpec, build_instance

    # The oracle estimate: the scheduler's claims are checked against its own model here.
    sched, ex = build_instance(InstanceSpec(policy, "llama3.1-8b", "h200", 4, TTFT, TBT,
                                            estimate="oracle"))
    checked = Checked(sched, ex)
    report = simulate(_requests(seed=5, count=200, rate=5.0, max_prompt=20_000), checked, ex,
                      TTFT, TBT)
    assert all(r.finish_s is not None for r in report.records)
    assert report.slo_claim_violations == 0
    sched.blocks.check_consistency()
    assert all(sched.blocks.utilization(r) == 0.0 for r in range(sched.n))


@pytest.mark.parametrize("mode", ["conflux", "isolated"])
def test_executor_shape_limits_are_respected(mode: str) -> None:
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT, mode=mode,  # type: ignore[arg-type]
                          max_prefill_pieces=2, max_decodes_per_rank=6)
    model = roofline_model("qwen3-14b", "h100", sp=4)
    sched = Scheduler(cfg, model, BlockManager(4, 3000, 16))
    ex = SimExecutor(model, KVSpec(4, 3000, 16))
    checked = Checked(sched, ex)
    seen = {"pieces": 0, "decodes": 0}

    def on_plan(plan, _result) -> None:
        seen["pieces"] = max(seen["pieces"], len(plan.prefill))
        per_rank = [0] * 4
        for d in plan.decode:
            per_rank[d.rank] += 1
        seen["decodes"] = max(seen["decodes"], max(per_rank), *sched._n_d)

    rep = simulate(_requests(seed=9, count=150, rate=10.0, max_prompt=3000, max_out=200),
                   checked, ex, TTFT, TBT, on_plan=on_plan)
    assert all(r.finish_s is not None for r in rep.records)
    assert seen["pieces"] == 2 and seen["decodes"] == 6


def test_per_request_slos_set_the_deadline_and_the_iteration_bound():
    from conflux_jax.latency.roofline import roofline_model
    from conflux_jax.scheduler.block_manager import BlockManager
    from conflux_jax.scheduler.config import SchedulerConfig
    from conflux_jax.scheduler.request import Request
    from conflux_jax.scheduler.scheduler import Scheduler

    model = roofline_model("qwen3-14b", "h100", 4)
    sched = Scheduler(SchedulerConfig(tbt_slo_s=0.1, ttft_slo_s=2.0), model,
                      BlockManager(4, 4096, 16))
    sched.add(Request(1, 0.0, 300, 5, ttft_slo_s=0.5, tbt_slo_s=0.03))
    sched.add(Request(2, 0.0, 300, 5))
    assert sched.state(1).deadline_s == 0.5
    assert sched.state(2).deadline_s == 2.0
    for _ in range(20):  # run until request 1 is decoding
        plan = sched.schedule(0.0)
        sched.commit(plan)
        if 1 in sched.decode_ranks():
            break
    plan = sched.schedule(0.0)
    # While request 1 decodes, every iteration must fit its tighter 30 ms TBT SLO.
    assert plan.estimated_latency_s <= 0.03 or not plan.fits_slo
    assert plan.fits_slo == (plan.estimated_latency_s <= 0.03)


@pytest.mark.parametrize("mode", ["conflux", "tp_chunked", "isolated"])
def test_cached_prefix_is_never_prefilled(mode: str) -> None:
    """A request whose first 3,000 prompt tokens are cached prefills only the rest, with
    the cached tokens as attention history, and decodes over its whole prompt."""
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT, mode=mode)  # type: ignore[arg-type]
    n = 1 if mode == "tp_chunked" else 4
    model = roofline_model("qwen3-14b", "h100", sp=n)
    sched = Scheduler(cfg, model, BlockManager(n, 5000, 16))
    ex = SimExecutor(model, KVSpec(n, 5000, 16))
    pieces = []
    report = simulate([Request(0, 0.0, 5000, 3, cached_prefix=3000)], sched, ex, TTFT, TBT,
                      on_plan=lambda plan, _: pieces.extend(plan.prefill))
    assert pieces[0].start == 3000
    assert sum(p.length for p in pieces) == 2000
    assert [p.start for p in pieces] == [3000 + sum(q.length for q in pieces[:i])
                                         for i in range(len(pieces))]
    assert report.records[0].tokens == 3 and report.records[0].finish_s is not None
    with pytest.raises(ValueError, match="cached_prefix"):
        Request(1, 0.0, 10, 1, cached_prefix=10)


def test_lost_kv_recomputes_every_request_that_held_it() -> None:
    """An executor that lost its KV (a failed compiled step) makes the core preempt every
    request holding pages, in the failed plan or not: the plan's requests are failed by
    the caller, the others recompute from their tokens and finish."""
    from conflux_jax.engine.core import EngineCore, StepFailed
    from conflux_jax.plan import KVLost

    class Losing(SimExecutor):
        fail_next = False

        def execute(self, plan):  # noqa: ANN001, ANN202
            if self.fail_next:
                self.fail_next = False
                raise KVLost("injected: the device lost the pools")
            return super().execute(plan)

    # Phase-isolated iterations: a prefill iteration leaves resident decodes out of the plan.
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT, mode="isolated")
    model = roofline_model("qwen3-14b", "h100", sp=4)
    sched = Scheduler(cfg, model, BlockManager(4, 3000, 16))
    ex = Losing(model, KVSpec(4, 3000, 16))
    core = EngineCore(sched, ex)
    for i, n in enumerate((500, 800)):
        core.add(Request(i, 0.0, n, 20))
    while sched.num_decoding < 2:
        core.step()
    core.step()  # one decode token each
    core.add(Request(2, ex.now(), 3000, 5))
    ex.fail_next = True
    with pytest.raises(StepFailed) as info:
        core.step()
    failed = set(info.value.plan.request_ids)
    assert failed == {2}  # a prefill-only plan: the two decodes held KV outside it
    for rid in failed:
        core.abort(rid)
    for rid in (0, 1):
        st = sched.state(rid)
        assert st.phase == "waiting" and st.prefilled == 0 and rid not in sched.blocks
        assert st.target == st.req.prompt_len + st.generated and st.generated >= 2
    assert all(sched.blocks.free_pages(r) == 3000 for r in range(4))
    finished = []
    while core.has_work:
        it = core.step()
        finished += it.finished if it else []
    assert sorted(finished) == [0, 1]
    sched.blocks.check_consistency()


@pytest.mark.parametrize("floor", [0, 16])
def test_prefill_never_starves_behind_decodes_that_fill_the_budget(floor: int) -> None:
    """A latency model under which the resident decodes alone exceed the TBT SLO (the
    built-in CPU estimate on a GPU) leaves no budget: without a floor the prompt waits
    for decodes to drain; with ``min_prefill_chunk`` it gets that many tokens every
    iteration, and each iteration still advances every decode."""
    from conflux_jax.engine.core import EngineCore
    from conflux_jax.latency import Affine, LatencyModel

    slow = LatencyModel(num_layers=1, num_ranks=2, gemm=Affine(a=0.0, b=0.2), dec=Affine(),
                        pre=Affine(), comm=Affine())  # 0.2 s per iteration > the 0.1 s TBT
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=1e6, min_prefill_chunk=floor)
    sched = Scheduler(cfg, slow, BlockManager(2, 200, 16))
    ex = SimExecutor(slow, KVSpec(2, 200, 16))
    core = EngineCore(sched, ex)
    core.add(Request(0, 0.0, 8, 50))  # an idle instance runs it (one quantum at a time)
    while sched.num_decoding < 1:
        core.step()
    core.add(Request(1, ex.now(), 100, 2))
    prefilled = []
    for _ in range(4):
        it = core.step()
        assert [d.request_id for d in it.plan.decode] == [0]  # stall-free
        prefilled.append(sum(p.length for p in it.plan.prefill))
    assert prefilled == [floor] * 4


@pytest.mark.parametrize("caching", [False, True])
def test_planning_ahead_feeds_every_row_the_tokens_it_would_have_had(caching: bool) -> None:
    """The engine's planning ahead: each plan is made after the previous one advanced
    but before its tokens are recorded. With a pool small enough to preempt, every
    decode slot's fed token (``last_tokens`` after the record) and every prefill piece's
    token ids (recompute prefills cover outputs) match a brute-force record of each
    request's prompt and outputs, and the run ends with every page free."""
    n, num_pages = 2, 24
    cfg = SchedulerConfig(tbt_slo_s=TBT, ttft_slo_s=TTFT, quantum=16,
                          max_tokens_per_rank=256, headroom_pages=1, token_budget=256,
                          enable_prefix_caching=caching)
    sched = Scheduler(cfg, roofline_model("qwen3-14b", "h100", sp=n),
                      BlockManager(n, num_pages, 16))
    rng = random.Random(7)
    truth: dict[int, list[int]] = {}  # request -> prompt + outputs sampled so far
    for i in range(12):
        prompt = tuple(rng.randrange(1000) for _ in range(rng.randint(20, 120)))
        truth[i] = list(prompt)
        assert sched.add(Request(i, 0.01 * i, len(prompt), rng.randint(20, 60),
                                 prompt_token_ids=prompt))

    def run(plan, sampled):  # the "device": check what the plan feeds, then sample
        for d, fed in zip(plan.decode, sched.last_tokens(plan), strict=True):
            assert fed == truth[d.request_id][-1]
        for p in plan.prefill:
            assert p.token_ids == tuple(truth[p.request_id][p.start:p.start + p.length])
        return StepResult({rid: SampledToken(next(sampled)) for rid in plan.sampling_ids},
                          0.0, 0.0)

    tokens = iter(range(10_000, 1_000_000))
    running = sched.schedule(0.0)
    result = run(running, tokens)
    now, finished = 0.0, []
    while True:
        finished += sched.advance(running)  # the running plan's progress, no tokens yet
        now += 0.05
        ahead = sched.schedule(now)  # planned before the running plan's tokens are known
        sched.record(running, result)
        for rid in running.sampling_ids:
            truth[rid].append(result.sampled[rid].token)
        if ahead.empty:
            sched.commit(ahead, None)
            if not sched.has_work:
                break
            ahead = sched.schedule(now)
        running, result = ahead, run(ahead, tokens)
    assert sorted(finished) == list(range(12))
    assert sched.num_preemptions > 0
    bm = sched.blocks
    assert all(bm.free_pages(r) == num_pages for r in range(n))
