"""Prefix caching on the real Conflux executor (4 simulated CPU devices).

Oracles: solo greedy generation with the dense single-device reference, and the same
engine with caching off. Workloads share prefixes across requests and turns, on pools
small enough that cached pages are evicted and decodes preempted.
"""

import dataclasses

import jax
import numpy as np
import pytest
from test_engine import BUCKETS, PARAMS, solo_greedy, word_tokenizer
from tiny_models import TINY_LLAMA

from conflux_jax.engine import Engine, EngineConfig
from conflux_jax.engine.engine import default_latency_model
from conflux_jax.executor.jax_executor import ExecutorConfig
from conflux_jax.latency import Affine
from conflux_jax.sampling import SamplingParams

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def make_engine(mesh="sp=4,tp=1", num_pages=128, policy="conflux", caching=True,
                **config) -> Engine:
    ec = ExecutorConfig(mesh=mesh, page_size=4, num_pages=num_pages, max_model_len=128,
                        buckets=BUCKETS, attention_impl=config.pop("attention_impl", None),
                        decode_attention=config.pop("decode_attention", "auto"),
                        prefill_attention=config.pop("prefill_attention", "auto"),
                        kv_layout=config.pop("kv_layout", "auto"))
    return Engine(TINY_LLAMA, PARAMS, word_tokenizer(),
                  EngineConfig(executor=ec, policy=policy, enable_prefix_caching=caching,
                               **config))


def record_plans(engine: Engine) -> list:
    """Every plan the engine's executor runs (the executor itself still runs them)."""
    plans = []
    run = engine.executor.launch  # how the engine (async scheduling) starts each plan

    def launch(plan, prepare=None, after=None):
        plans.append(plan)
        return run(plan, prepare, after)

    engine.executor.launch = launch
    return plans


def shared_prefix_waves(seed: int, waves: int = 3, per_wave: int = 5,
                        longest: int = 60) -> list[list[list[int]]]:
    """Waves of prompts: a few shared system prefixes plus random suffixes, and follow-up
    turns that extend an earlier prompt of the same conversation."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(3, 256, int(n)).tolist() for n in rng.integers(8, longest, 3)]
    convs: list[list[int]] = []
    out = []
    for _ in range(waves):
        wave = []
        for _ in range(per_wave):
            if convs and rng.random() < 0.5:  # the next turn of a conversation
                i = int(rng.integers(len(convs)))
                convs[i] = (convs[i] + rng.integers(3, 256, int(rng.integers(1, 12))).tolist()
                            )[-(longest + 20):]
                wave.append(convs[i])
            else:
                p = prefixes[int(rng.integers(len(prefixes)))]
                wave.append(p + rng.integers(3, 256, int(rng.integers(1, 20))).tolist())
                convs.append(wave[-1])
        out.append(wave)
    return out


def run_waves(engine: Engine, waves) -> list[list[int]]:
    tokens = []
    for wave in waves:
        tokens += [o.outputs[0].token_ids for o in engine.generate(wave, [GREEDY] * len(wave))]
    return tokens


def assert_all_free(engine: Engine) -> None:
    """Every refcount zero, every page free or cached-free."""
    bm = engine.scheduler.blocks
    bm.check_consistency()
    assert not bm.requests
    assert all(bm.free_pages(r) == bm.num_pages for r in range(bm.num_ranks))


def test_shared_prefixes_give_the_reference_tokens_and_those_of_caching_off():
    waves = shared_prefix_waves(seed=3)
    on = make_engine()
    plans = record_plans(on)
    got = run_waves(on, waves)
    prompts = [p for w in waves for p in w]
    assert got == [solo_greedy(p, 6) for p in prompts]
    assert got == run_waves(make_engine(caching=False), waves)
    sched = on.scheduler
    assert sched.prefix_hits > 0.3 * sched.prefix_queries  # the waves do share prefixes
    loads = [p for plan in plans for p in plan.prefill if p.load_pages]
    assert loads and all(p.start == 4 * len(p.load_pages) for p in loads)
    assert any(p.resident_tokens for plan in plans for p in plan.prefill)  # owner affinity
    assert_all_free(on)


def test_link_bytes_count_the_loads():
    """A step that loads a cached prefix (and moves no KV) sends N-1 of each loaded page's
    N head shards over links (K and V, every layer)."""
    engine = make_engine(local_prefill=False)
    prefix = list(range(3, 43))
    engine.generate([prefix], [GREEDY])
    ex = engine.executor
    sent = []
    run = ex.launch  # how the engine starts each plan

    def launch(plan, prepare=None, after=None):
        out = run(plan, prepare, after)
        sent.append((plan, ex.last_transfer_bytes))
        return out

    ex.launch = launch
    engine.generate([prefix + [5] * 9], [dataclasses.replace(GREEDY, max_tokens=1)])
    ((plan, got),) = [(p, b) for p, b in sent if p.prefill]
    (piece,) = plan.prefill
    assert len(piece.load_pages) == 10 and piece.resident_tokens == 40  # on the owner
    m = ex.step_config.model
    page = 4 * m.num_kv_heads * m.head_dim * 4  # f32, all heads
    moved = -(-(40 + 9) // 16) - 40 // 16  # page groups (4 pages) not wholly on the owner
    # a loaded page sends 3 of its 4 head shards; a moved group 3 of its 4 pages
    assert got == 2 * m.num_layers * page * (10 * 3 + moved * 3 * 4) // 4


def slow_links(num_ranks: int):
    """The built-in estimate with a costly all-to-all: the owner-alone path wins a hit
    whenever its suffix fits the owner's decode slice."""
    return dataclasses.replace(
        default_latency_model(TINY_LLAMA.num_layers, num_ranks).for_buckets(BUCKETS.tokens),
        comm=Affine(b=0.01))


@pytest.mark.parametrize("seed,links", [(11, "estimate"), (11, "slow")])
def test_eviction_and_preemption_lose_nothing(seed, links):
    """A pool too small for the waves' prefixes and growing decodes: cached pages are
    evicted, decodes preempted and recomputed (finding their own prefix again), and some
    completions land off their owner rank; every token is still the reference's (also when
    slow links send the hits' suffixes to their owners alone)."""
    waves = shared_prefix_waves(seed, waves=3, per_wave=8)
    engine = make_engine(num_pages=40,
                         **({"latency_model": slow_links(4)} if links == "slow" else {}))
    plans = record_plans(engine)
    long = dataclasses.replace(GREEDY, max_tokens=24)
    tokens = []
    for wave in waves:
        tokens += [o.outputs[0].token_ids for o in engine.generate(wave, [long] * len(wave))]
    prompts = [p for w in waves for p in w]
    assert tokens == [solo_greedy(p, 24) for p in prompts]
    assert engine.scheduler.num_preemptions > 0
    moved_off_owner = [p for plan in plans for p in plan.prefill
                       if p.completes and p.load_rank is not None
                       and p.load_rank != p.decode_rank]
    assert engine.scheduler.prefix_hits > 0
    assert_all_free(engine)
    assert moved_off_owner  # the owner was full: the decode went elsewhere
    if links == "slow":
        assert engine.scheduler.local_prefills > 0


def test_abort_mid_prefill_of_a_request_sharing_blocks():
    engine = make_engine(tbt_slo_s=1e-6, min_prefill_chunk=16)  # 16 prefill tokens a step
    rng = np.random.default_rng(7)
    prefix = rng.integers(3, 256, 48).tolist()
    engine.generate([prefix + [9]], [GREEDY])  # caches the prefix
    long = prefix + rng.integers(3, 256, 60).tolist()
    rid = engine.add_request(long, GREEDY)
    engine.step()
    st = engine.scheduler.state(rid)
    assert st is not None and st.cached == 48 and st.phase == "prefill"
    assert st.prefilled < len(long)
    engine.abort(rid)
    while engine.scheduler.has_work:
        engine.step()
    assert_all_free(engine)
    again = prefix + [11, 12]
    assert engine.generate([again], [GREEDY])[0].outputs[0].token_ids == solo_greedy(again, 6)
    assert engine.scheduler.state(rid) is None


@pytest.mark.parametrize("mesh,policy,impl,kv_layout", [
    ("sp=2,tp=2", "conflux", None, "auto"),
    ("sp=1,tp=4", "chunked", None, "auto"),
    ("sp=4,tp=1", "isolated", None, "auto"),
    ("sp=4,tp=1", "conflux", "interpret", "auto"),  # the Pallas kernel
    # one K/V pool (JAX's TPU kernel's layout): loads, writes and transfers of K/V pairs
    ("sp=2,tp=2", "conflux", None, "combined"),
])
def test_meshes_policies_and_the_pallas_kernel(mesh, policy, impl, kv_layout):
    waves = shared_prefix_waves(seed=5, waves=2, per_wave=2, longest=40)
    engine = make_engine(mesh, policy=policy, attention_impl=impl, kv_layout=kv_layout)
    assert len(engine.executor.kv_pools) == (1 if kv_layout == "combined" else 2)
    got = run_waves(engine, waves)
    assert got == [solo_greedy(p, 6) for w in waves for p in w]
    assert engine.scheduler.prefix_hits > 0
    assert_all_free(engine)


def test_cache_salt_keeps_tenants_apart_and_usage_reports_cached_tokens():
    engine = make_engine()
    prompt = list(range(3, 43))
    a = engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
    cached = {}
    while engine.has_unfinished:
        for out in engine.step():
            if out.num_cached_tokens is not None:
                cached[out.request_id] = out.num_cached_tokens
    b = engine.add_request(prompt, GREEDY, cache_salt="tenant-b")
    c = engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
    while engine.has_unfinished:
        for out in engine.step():
            if out.num_cached_tokens is not None:
                cached[out.request_id] = out.num_cached_tokens
    assert cached[a] == 0 and cached[b] == 0
    assert cached[c] == 36  # 9 full pages of 4; the last token is always computed


def test_n_choices_prefill_their_prompt_once_and_share_its_pages():
    engine = make_engine()
    plans = record_plans(engine)
    prompt = list(range(3, 43))  # 40 tokens: 9 full pages before the last token
    (out,) = engine.generate([prompt], [dataclasses.replace(GREEDY, n=4)])
    assert [c.token_ids for c in out.outputs] == [solo_greedy(prompt, 6)] * 4
    prefills = [p for plan in plans for p in plan.prefill]
    local = [lp for plan in plans for lp in plan.local_prefill]
    # once, then each choice's tail (loaded and Ulysses-prefilled, or on the owner alone)
    assert sum(p.length for p in prefills) + sum(lp.length for lp in local) == 40 + 3 * 4
    owner = prefills[0].decode_rank
    loads = [p for p in prefills if p.load_pages]
    assert len(loads) + len(local) == 3
    assert all(p.start == 36 and p.load_rank == owner for p in loads)
    assert all(lp.start == 36 and lp.rank == owner for lp in local)
    assert all(p.decode_rank == owner for p in prefills if p.completes)  # on its pages
    assert engine.scheduler.prefix_hits == 3 * 36
    assert_all_free(engine)


@pytest.mark.parametrize("mesh,impl,attention", [
    ("sp=4,tp=1", None, "auto"),  # decode rows and suffixes by the CPU handlers
    ("sp=2,tp=2", None, "auto"),
    ("sp=4,tp=1", None, "rpa"),  # by the kernel's jnp path
    ("sp=4,tp=1", "interpret", "auto"),  # by the Pallas kernel
])
def test_suffixes_prefilled_on_the_owner_alone_give_the_reference_tokens(mesh, impl,
                                                                         attention):
    """With links priced slow, a hit whose suffix fits the owner's decode slice runs there
    alone (decode-slice rows over its cached pages, beside resident decodes and other
    prompts' Ulysses chunks); every token is still the dense reference's."""
    waves = shared_prefix_waves(seed=3)
    engine = make_engine(mesh, latency_model=slow_links(4 if mesh.startswith("sp=4") else 2),
                         attention_impl=impl, decode_attention=attention,
                         prefill_attention=attention)
    plans = record_plans(engine)
    got = run_waves(engine, waves)
    assert got == [solo_greedy(p, 6) for w in waves for p in w]
    local = [lp for plan in plans for lp in plan.local_prefill]
    assert len(local) >= 4 and max(lp.length for lp in local) > 1
    assert any(plan.local_prefill and plan.decode for plan in plans)
    assert any(plan.local_prefill and plan.prefill for plan in plans)
    assert_all_free(engine)
