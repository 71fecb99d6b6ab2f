"""The prefix cache: chained page hashes, one rank's LRU page pool, and the scheduler's use
of both over random shared-prefix workloads (simulated executor)."""

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from conflux_jax.latency import BatchShape
from conflux_jax.latency.roofline import roofline_model
from conflux_jax.plan import KVSpec, LocalPrefill
from conflux_jax.scheduler.block_manager import BlockManager
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.prefix_cache import (
    RankPages,
    block_id_page_keys,
    chain_hashes,
    token_page_keys,
)
from conflux_jax.scheduler.request import Request
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.sim import SimExecutor

PS = 4


def hashes(tokens, salt=""):
    return chain_hashes(token_page_keys(tokens, PS), salt=salt)


def test_chained_hashes_name_whole_prefixes():
    a = hashes(list(range(16)))
    assert len(a) == 4 and len(set(a)) == 4
    assert hashes(list(range(13))) == a[:3]  # only full pages are named
    changed = list(range(16))
    changed[9] = 99  # page 2
    b = hashes(changed)
    assert b[:2] == a[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert not set(hashes(list(range(16)), salt="t")) & set(a)  # salts never share
    # extending a chain from its last hash is the same as hashing the whole
    assert chain_hashes(token_page_keys(list(range(8, 16)), PS), parent=a[1]) == a[2:]


def test_trace_block_ids_name_pages_by_block_and_offset():
    keys = block_id_page_keys([7, 8], block_tokens=8, page_size=PS, num_tokens=14)
    assert len(keys) == 3  # 14 tokens: 3 full pages (the fourth is partial)
    again = block_id_page_keys([7, 9], block_tokens=8, page_size=PS, num_tokens=16)
    assert keys[:2] == again[:2] and keys[2] != again[2]


def test_rank_pool_evicts_least_recently_freed_cached_pages_tail_first():
    pool = RankPages(6)
    a = pool.take(3)
    pool.register(a, hashes(list(range(12))))
    pool.release(a)  # tail first: a[2] is the oldest free cached page
    assert pool.num_free() == 6 and pool.num_cached_free() == 3
    assert pool.longest_hit(hashes(list(range(12)))) == a
    fresh = pool.take(3)  # uncached free pages go first: nothing evicted
    assert not set(fresh) & set(a) and pool.num_cached() == 3
    pool.take(1)  # now the LRU's head: the prefix's last page
    assert pool.longest_hit(hashes(list(range(12)))) == a[:2]
    pool.acquire(a[:2])  # a hit leaves the LRU queue
    assert pool.num_cached_free() == 0 and pool.refcount(a[0]) == 1
    pool.check([*fresh, *a[:2], a[2]])


def test_duplicates_keep_the_first_copy_and_clear_forgets_everything():
    pool = RankPages(4)
    h = hashes(list(range(8)))
    a, b = pool.take(2), pool.take(2)
    pool.register(a, h)
    pool.register(b, h)  # a recompute of the same prefix: already cached
    assert pool.longest_hit(h) == a and pool.num_cached() == 2
    pool.release(b)
    pool.release(a)
    pool.clear()
    assert pool.num_cached() == 0 and pool.num_free() == 4 and pool.longest_hit(h) == []


PREFIXES = [list(range(100 + 40 * i, 100 + 40 * i + n)) for i, n in enumerate((9, 23, 40))]


def _workload(seed: int, count: int) -> list[Request]:
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(count):
        t += rng.expovariate(20.0)
        prefix = rng.choice(PREFIXES)[:rng.randint(1, 40)]
        prompt = prefix + [rng.randint(3, 99) for _ in range(rng.randint(1, 30))]
        out.append(Request(i, t, len(prompt), rng.randint(1, 40),
                           prompt_token_ids=tuple(prompt), cache_salt=rng.choice(["", "x"])))
    return out


def _run(reqs: list[Request], n: int, num_pages: int, abort_frac: float, seed: int,
         mode: str = "conflux", local: bool = True):
    """Run ``reqs`` to the end; returns (scheduler, block manager, hits served by a load,
    hits served locally, hits of a preempted request's recompute)."""
    cfg = SchedulerConfig(tbt_slo_s=0.05, ttft_slo_s=1.0, mode=mode,  # type: ignore[arg-type]
                          order="fcfs" if mode != "conflux" else "slo", quantum=4,
                          max_tokens_per_rank=64, headroom_pages=1, token_budget=64,
                          max_transfer_groups=4, max_decodes_per_rank=16,
                          local_prefill=local)
    model = roofline_model("qwen3-14b", "h100", sp=n, tp=4 // n)
    bm = BlockManager(n, num_pages, PS)
    sched = Scheduler(cfg, model, bm)
    ex = SimExecutor(model, KVSpec(n, num_pages, PS))
    rng = random.Random(seed)
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    loads, locals_, preempted_then_hit, seen_preempted = 0, 0, 0, set()
    while pending or sched.has_work:
        while pending and pending[0].arrival_s <= ex.now():
            sched.add(pending.pop(0))
        if not sched.has_work:
            if not pending:
                break  # the rest could never fit and were refused
            ex.advance_to(pending[0].arrival_s)
            continue
        plan = sched.schedule(ex.now())
        seen_preempted |= set(plan.preempted)
        for p in plan.prefill:
            if p.load_pages:
                loads += 1
                preempted_then_hit += p.request_id in seen_preempted
                assert p.start == PS * len(p.load_pages)
                assert p.load_rank is not None
                assert p.resident_tokens <= p.start
        for lp in plan.local_prefill:  # the suffix on the owner, over its cached pages
            locals_ += 1
            preempted_then_hit += lp.request_id in seen_preempted
            assert lp.start % PS == 0 and lp.start > 0 and lp.length >= 1
            assert len(lp.token_ids) == lp.length
            assert len(lp.pages) == -(-(lp.start + lp.length + 1) // PS)
            assert bm.decode_rank(lp.request_id) == lp.rank
        assert max(plan.decode_per_rank(n)) <= 16  # the decode slice's rows
        if rng.random() < abort_frac and plan.request_ids:
            sched.abort(rng.choice(plan.request_ids))  # mid-iteration: deferred
        sched.commit(plan, ex.execute(plan) if not plan.empty else None)
        bm.check_consistency()
    return sched, bm, loads, locals_, preempted_then_hit


@settings(max_examples=25, deadline=None)
@given(seed=hs.integers(0, 10_000), n=hs.sampled_from([1, 2, 4]),
       num_pages=hs.sampled_from([24, 40, 200]), abort_frac=hs.sampled_from([0.0, 0.2]),
       mode=hs.sampled_from(["conflux", "tp_chunked", "isolated"]), local=hs.booleans())
def test_random_shared_prefix_runs_leave_every_page_free(seed, n, num_pages, abort_frac,
                                                         mode, local):
    if mode == "tp_chunked":
        n = 1
    sched, bm, *_ = _run(_workload(seed, 40), n, num_pages, abort_frac, seed, mode, local)
    assert not bm.requests
    assert all(bm.free_pages(r) == bm.num_pages for r in range(n))
    assert 0 <= sched.prefix_hits <= sched.prefix_queries


@pytest.mark.parametrize("local", [True, False])
def test_hits_are_priced_and_preempted_requests_find_their_own_prefix(local):
    sched, bm, loads, locals_, preempted_then_hit = _run(_workload(1, 120), 4, 24, 0.0, 1,
                                                         local=local)
    # Both paths serve hits when the owner may prefill alone; only loads when it may not.
    assert (locals_ > 5 and loads > 5) if local else (locals_ == 0 and loads > 10)
    assert sched.prefix_hits > 0.2 * sched.prefix_queries
    assert sched.num_preemptions > 0 and preempted_then_hit > 0
    assert sum(bm.cached_pages(r) for r in range(4)) > 0  # cached pages outlive requests


def _two_ranks(local: bool = True) -> tuple[Scheduler, BlockManager, SimExecutor]:
    model = roofline_model("qwen3-14b", "h100", sp=2, tp=2)
    bm = BlockManager(2, 64, PS)
    sched = Scheduler(SchedulerConfig(tbt_slo_s=1.0, ttft_slo_s=10.0, quantum=4,
                                      local_prefill=local), model, bm)
    return sched, bm, SimExecutor(model, KVSpec(2, 64, PS))


@pytest.mark.parametrize("local", [True, False])
def test_a_hit_prefills_only_the_uncached_suffix_and_decodes_on_the_owner(local):
    """A short suffix runs on the owner alone over its cached pages (or, with that path
    off, loads the prefix into every rank's prefill pages and moves only the suffix)."""
    sched, bm, ex = _two_ranks(local)
    prompt = tuple(range(3, 30))  # 27 tokens: 6 full pages
    owner, cached = -1, ()
    for rid, p in ((0, prompt), (1, prompt + (5, 6))):
        sched.add(Request(rid, 0.0, len(p), 2, prompt_token_ids=p))
        plan = sched.schedule(ex.now())
        if rid == 0:
            (piece,) = plan.prefill
            owner = piece.decode_rank
            assert not piece.load_pages and not plan.local_prefill
        elif local:
            (lp,) = plan.local_prefill
            assert not plan.prefill
            assert (lp.rank, lp.start, lp.length, lp.token_ids) == (owner, 24, 5, p[24:])
            assert lp.pages[:6] == cached and len(lp.pages) == 8  # 30 tokens of KV
        else:
            (piece,) = plan.prefill
            assert (piece.start, piece.length) == (24, 5)  # 6 cached pages, 5 tokens left
            assert piece.load_rank == owner and piece.load_pages == cached
            assert piece.decode_rank == owner and piece.resident_tokens == 24
        if rid == 1:
            assert sched.state(1).cached_tokens == 24
        sched.commit(plan, ex.execute(plan))
        if rid == 0:
            cached = tuple(bm.decode_pages(0)[:6])
    assert sched.prefix_queries == 27 + 29 and sched.prefix_hits == 24
    while sched.has_work:
        plan = sched.schedule(ex.now())
        sched.commit(plan, ex.execute(plan))
    # both decoded on the owner; the shared pages were freed once each, then cached-free
    bm.check_consistency()
    assert bm.cached_pages(owner) >= 6


def test_lost_kv_forgets_the_cache():
    sched, bm, ex = _two_ranks()
    p = tuple(range(3, 30))
    sched.add(Request(0, 0.0, len(p), 8, prompt_token_ids=p))
    for _ in range(3):
        plan = sched.schedule(ex.now())
        sched.commit(plan, ex.execute(plan))
    # 6 prompt pages, and the 7th once the first decoded token filled it (outputs are
    # cached too: a conversation's next turn resends them)
    assert sum(bm.cached_pages(r) for r in range(2)) == 7
    assert sched.recompute_all() == [0]
    assert sum(bm.cached_pages(r) for r in range(2)) == 0
    plan = sched.schedule(ex.now())
    assert plan.prefill[0].start == 0 and not plan.prefill[0].load_pages


@pytest.mark.parametrize("caching", [True, False])
def test_choices_of_one_prompt_wait_for_its_prefill_then_share_its_pages(caching):
    """n choices of one prompt (n requests with the same tokens) prefill it once: the
    others wait for its pages to be named, then prefill only the last page's tokens on
    the owner's pages. Without caching every choice prefills the whole prompt at once."""
    model = roofline_model("qwen3-14b", "h100", sp=2, tp=2)
    bm = BlockManager(2, 64, PS)
    sched = Scheduler(SchedulerConfig(tbt_slo_s=1.0, ttft_slo_s=10.0, quantum=4,
                                      enable_prefix_caching=caching), model, bm)
    ex = SimExecutor(model, KVSpec(2, 64, PS))
    prompt = tuple(range(3, 30))  # 27 tokens: 6 full pages
    for rid in range(4):
        sched.add(Request(rid, 0.0, len(prompt), 2, prompt_token_ids=prompt))
    plan = sched.schedule(ex.now())
    if not caching:
        assert sorted(p.request_id for p in plan.prefill) == [0, 1, 2, 3]
        assert all(p.start == 0 for p in plan.prefill)
        return
    (first,) = plan.prefill
    assert first.completes and first.start == 0
    sched.commit(plan, ex.execute(plan))
    plan = sched.schedule(ex.now())
    # The short tails run on the owner alone, over its pages.
    choices = plan.local_prefill
    assert not plan.prefill
    assert sorted(p.request_id for p in choices) == sorted({0, 1, 2, 3} - {first.request_id})
    for p in choices:
        assert (p.start, p.length) == (24, 3)
        assert p.rank == first.decode_rank
        assert p.pages[:6] == first.decode_pages[:6]
    sched.commit(plan, ex.execute(plan))
    assert sched.prefix_hits == 3 * 24
    while sched.has_work:
        plan = sched.schedule(ex.now())
        sched.commit(plan, ex.execute(plan))
    bm.check_consistency()
    assert all(bm.free_pages(r) == bm.num_pages for r in range(2))


def test_a_short_shared_head_does_not_hold_a_prompt_back():
    """Two prompts sharing one page of 11: waiting would save too little, so both start."""
    sched, _, ex = _two_ranks()
    head = tuple(range(3, 7))
    for rid in range(2):
        tail = tuple(range(40 + 10 * rid, 47 + 10 * rid))
        sched.add(Request(rid, 0.0, 11, 2, prompt_token_ids=head + tail))
    plan = sched.schedule(ex.now())
    assert sorted(p.request_id for p in plan.prefill) == [0, 1]


@pytest.mark.parametrize("suffix", [8, 3000])
def test_the_latency_model_chooses_the_owner_alone_or_ulysses(suffix):
    """A hit's suffix runs on the owner alone exactly when the latency model prices that
    plan at most the load + Ulysses plan: a short suffix saves the load and the
    all-to-alls; a long one needs every rank's linears."""
    model = roofline_model("qwen3-14b", "h100", sp=4, tp=1)
    prefix = tuple(range(3, 3 + 64 * PS))
    tail = tuple(7 + i % 90 for i in range(suffix))
    plans = {}
    for local in (True, False):
        bm = BlockManager(4, 4096, PS)
        sched = Scheduler(SchedulerConfig(tbt_slo_s=10.0, ttft_slo_s=100.0, quantum=4,
                                          local_prefill=local), model, bm)
        ex = SimExecutor(model, KVSpec(4, 4096, PS))
        sched.add(Request(0, 0.0, len(prefix), 50, prompt_token_ids=prefix))
        for _ in range(2):
            plan = sched.schedule(ex.now())
            sched.commit(plan, ex.execute(plan))
        sched.add(Request(1, ex.now(), len(prefix) + suffix, 2,
                          prompt_token_ids=prefix + tail))
        plans[local] = sched.schedule(ex.now())
    on, off = plans[True], plans[False]
    (ulysses,) = off.prefill
    assert ulysses.load_rank is not None and ulysses.length == suffix  # whole, one chunk
    owner = ulysses.load_rank
    price = lambda plan: model.estimate(BatchShape.from_plan(plan, 4))  # noqa: E731
    alone = dataclasses.replace(off, prefill=(), local_prefill=(LocalPrefill(
        1, owner, len(prefix), length=suffix),))
    assert (price(alone) <= price(off)) == (suffix == 8)  # the model's verdict
    if suffix == 8:
        (lp,) = on.local_prefill
        assert not on.prefill and (lp.rank, lp.start, lp.length) == (owner, len(prefix), 8)
        assert price(on) == pytest.approx(price(alone))
    else:
        assert not on.local_prefill and on.prefill == off.prefill
