"""The CPU's attention handlers (XLA FFI calls) equal the numpy oracle of ragged paged
attention: decode calls and ragged prefill calls (fresh prompts, chunks after history, one
token, several key blocks), GQA, unequal lengths over scattered pages, padding rows and
slots past ``num_seqs``, empty sequences, page ids past the pool; fp32 only. The KV write
handler equals the numpy oracle of ``write_kv`` on one layer of a stacked pool, in place; the
page copy handler equals copying pages one by one in numpy."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.cpu_attention import (
    paged_attention_available,
    paged_copy_pages,
    paged_decode,
    paged_kv_write,
    paged_prefill,
)
from pallas_kernels.kv_write import ref_write_kv
from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention

pytestmark = pytest.mark.skipif(not paged_attention_available()[0],
                                reason=paged_attention_available()[1])


def _case(rng, seqs, lens, hq, hkv, d, page_size=4, num_pages=128, width=12):
    q = rng.standard_normal((seqs, hq, d)).astype(np.float32)
    k = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    v = rng.standard_normal((num_pages, page_size, hkv, d)).astype(np.float32)
    table = np.full((seqs, width), 10**6, np.int32)  # unused entries point past the pool
    free = list(rng.permutation(num_pages))
    for s, n in enumerate(lens):
        for j in range(math.ceil(n / page_size)):
            table[s, j] = free.pop()
    kv_lens = np.zeros(seqs, np.int32)
    kv_lens[: len(lens)] = lens
    return q, k, v, kv_lens, table


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 16), (8, 2, 8), (6, 2, 128)])
@pytest.mark.parametrize("lens", [[1], [5, 17, 48, 2], [48] * 6 + [3, 30]])
@pytest.mark.parametrize("page_size", [4, 16, 32])  # d = 64, 128: keys in tiles of <= 16
def test_matches_the_oracle(hq, hkv, d, lens, page_size):
    rng = np.random.default_rng(len(lens) * 100 + hq)
    seqs = len(lens) + 2  # two padding slots past num_seqs
    q, k, v, kv_lens, table = _case(rng, seqs, lens, hq, hkv, d, page_size)
    kv_lens[-1] = 7  # a padding slot's length must not make it attend
    num = np.int32(len(lens))
    cu = np.arange(seqs + 1, dtype=np.int32)
    scale = 1 / math.sqrt(d)
    got = np.asarray(jax.jit(paged_decode, static_argnums=6)(
        q, k, v, kv_lens, table, num, scale))
    clipped = np.minimum(table, len(k) - 1)  # the oracle indexes only pages of the pool
    want = np.asarray(ref_ragged_paged_attention(q, k, v, kv_lens, clipped, cu, num,
                                                 sm_scale=scale))
    np.testing.assert_allclose(got[: len(lens)], want[: len(lens)], rtol=2e-5, atol=2e-5)
    assert not got[len(lens):].any()


def test_a_batch_split_over_threads_matches():
    """Past 512 keys in all the call splits its sequences over threads by KV length."""
    rng = np.random.default_rng(3)
    lens = [500, 3, 260, 511, 1, 90, 333]
    q, k, v, kv_lens, table = _case(rng, len(lens), lens, 6, 2, 32, page_size=16,
                                    num_pages=160, width=32)
    cu = np.arange(len(lens) + 1, dtype=np.int32)
    num = np.int32(len(lens))
    got = np.asarray(paged_decode(q, k, v, kv_lens, table, num, 0.2))
    want = np.asarray(ref_ragged_paged_attention(q, k, v, kv_lens, np.minimum(table, 159), cu,
                                                 num, sm_scale=0.2))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_an_empty_sequence_gives_a_zero_row():
    rng = np.random.default_rng(1)
    q, k, v, kv_lens, table = _case(rng, 3, [0, 9, 0], 4, 2, 16)
    got = np.asarray(paged_decode(q, k, v, kv_lens, table, np.int32(3), 0.25))
    assert not got[0].any() and not got[2].any() and got[1].any()


def _ragged(rng, q_lens, kv_lens, hq, hkv, d, page_size=4, num_pages=256, pad=3):
    """A prefill call: ``q_lens`` query tokens of sequences holding ``kv_lens`` keys, then
    ``pad`` padding rows, two padding sequences, a table wide enough for the longest."""
    width = max(math.ceil(n / page_size) for n in kv_lens) + 1
    num_pages = max(num_pages, sum(math.ceil(n / page_size) for n in kv_lens) + 8)
    q, k, v, lens, table = _case(rng, len(q_lens) + 2, kv_lens, hq, hkv, d, page_size,
                                 num_pages, width)
    q = rng.standard_normal((sum(q_lens) + pad, hq, d)).astype(np.float32)
    cu = np.full(len(q_lens) + 3, sum(q_lens), np.int32)
    cu[: len(q_lens) + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    lens[-1] = 5  # a padding sequence's length must not make it attend
    return q, k, v, lens, table, cu, np.int32(len(q_lens))


def _check_prefill(q, k, v, lens, table, cu, num, scale):
    got = np.asarray(jax.jit(paged_prefill, static_argnums=7)(
        q, k, v, lens, table, cu, num, scale))
    want = ref_ragged_paged_attention(q, k, v, lens, np.minimum(table, len(k) - 1), cu, num,
                                      sm_scale=scale)
    live = int(cu[int(num)])
    np.testing.assert_allclose(got[:live], want[:live], rtol=2e-5, atol=2e-5)
    assert not got[live:].any()  # padding rows stay zero


@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (4, 4, 16), (8, 2, 8), (6, 2, 128)])
@pytest.mark.parametrize(("q_lens", "kv_lens"), [
    ([128, 128], [128, 128]),  # fresh prompts
    ([40, 1, 7], [300, 1, 90]),  # chunks after history (> one key block), a lone token
    ([200], [200]),  # a fresh prompt over several key blocks and row blocks
    ([0, 5], [33, 5]),  # an empty sequence between
])
def test_prefill_matches_the_oracle(hq, hkv, d, q_lens, kv_lens):
    rng = np.random.default_rng(sum(q_lens) + hq)
    _check_prefill(*_ragged(rng, q_lens, kv_lens, hq, hkv, d), 1 / math.sqrt(d))


@settings(max_examples=25, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 70), st.integers(0, 150)), min_size=1,
                       max_size=5),
       page_size=st.sampled_from([1, 4, 16]), group=st.sampled_from([1, 3, 4]))
def test_prefill_on_random_ragged_batches(chunks, page_size, group):
    """Any chunk length after any history (keys = history + chunk), any page size."""
    rng = np.random.default_rng(len(chunks) * 1000 + page_size * 10 + group)
    q_lens = [c for c, _ in chunks]
    kv_lens = [c + h for c, h in chunks]
    if max(kv_lens) == 0:
        kv_lens[0] = q_lens[0] = 1
    _check_prefill(*_ragged(rng, q_lens, kv_lens, 2 * group, 2, 16, page_size, 512), 0.3)


def test_other_dtypes_are_refused_by_name():
    rng = np.random.default_rng(2)
    q, k, v, kv_lens, table = _case(rng, 2, [3, 4], 4, 2, 16)
    with pytest.raises(ValueError, match="paged_decode is fp32 only, got k_pages bfloat16"):
        paged_decode(q, jnp.asarray(k, jnp.bfloat16), v, kv_lens, table, np.int32(2), 0.25)
    cu = np.array([0, 1, 2], np.int32)
    with pytest.raises(ValueError, match="paged_prefill is fp32 only, got q bfloat16"):
        paged_prefill(jnp.asarray(q, jnp.bfloat16), k, v, kv_lens, table, cu, np.int32(2))


def test_loading_the_handler_keeps_subnormals():
    """The library must not set the process's flush-to-zero state (what linking GCC's
    crtfastmath does): numpy, XLA and hypothesis all rely on IEEE subnormals."""
    paged_decode(*_case(np.random.default_rng(4), 1, [3], 4, 2, 16)[:5], np.int32(1), 0.25)
    tiny = np.finfo(np.float32).smallest_subnormal
    assert tiny * np.float32(3.0) > 0  # denormals-are-zero would read tiny as 0
    assert np.float32(1e-38) / np.float32(100.0) > 0  # flush-to-zero would drop this


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_write_matches_the_oracle_on_its_layer_only(dtype):
    """Rows land in their slots of the one layer named; padding (negative slots, slots past
    the layer's end) writes nothing; every other layer is untouched."""
    rng = np.random.default_rng(5)
    layers, pages, ps, hkv, d, t = 3, 6, 16, 3, 64, 37
    pool = jnp.asarray(rng.standard_normal((layers, pages, ps, hkv, d)), dtype)
    rows = jnp.asarray(rng.standard_normal((t, hkv, d)), dtype)
    slots = rng.permutation(pages * ps)[:t].astype(np.int32)
    slots[::5] = -3
    slots[1::7] = pages * ps + 2
    before = np.asarray(pool)
    out = np.asarray(jax.jit(paged_kv_write)(pool, 1, rows, slots))  # slots: ps per page
    want, _ = ref_write_kv(before[1], before[1], np.asarray(rows), np.asarray(rows), slots)
    np.testing.assert_array_equal(out[1], want)
    np.testing.assert_array_equal(out[[0, 2]], before[[0, 2]])


def test_kv_write_updates_a_carried_pool_in_place():
    """Carried through a scan over layers and donated, the pool is written where it lies:
    the compiled step holds no copy of the pool and the result equals layer-by-layer
    scatters (XLA's own, an independent form)."""
    rng = np.random.default_rng(6)
    layers, slots_per_layer, hkv, d, t = 4, 64, 2, 16, 5
    pool = jnp.asarray(rng.standard_normal((layers, slots_per_layer, hkv, d)), jnp.float32)
    rows = jnp.asarray(rng.standard_normal((layers, t, hkv, d)), jnp.float32)
    slots = np.array([3, -1, 63, 0, 17], np.int32)

    def write_all(write, pool, rows):
        def body(pool, layer):
            return write(pool, layer, rows[layer]), None
        return jax.lax.scan(body, pool, jnp.arange(layers, dtype=jnp.int32))[0]

    def by_xla(pool, layer, new):
        return pool.at[layer, jnp.where(slots >= 0, slots, slots_per_layer)].set(
            new, mode="drop")

    want = jax.jit(lambda p, r: write_all(by_xla, p, r))(pool, rows)
    step = jax.jit(lambda p, r: write_all(lambda *a: paged_kv_write(*a, slots), p, r),
                   donate_argnums=0)
    hlo = step.lower(pool, rows).compile().as_text()
    pool_shape = f"f32[{layers},{slots_per_layer},{hkv},{d}]"
    assert not re.search(re.escape(pool_shape) + r"\{[\d,]*\} copy(-start)?\(", hlo)
    got = step(pool, rows)
    assert pool.is_deleted()
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_kv_write_refuses_rows_that_do_not_fit_the_pool():
    pool = jnp.zeros((2, 8, 2, 4), jnp.float32)
    with pytest.raises(ValueError, match="do not fit the pool"):
        paged_kv_write(pool, 0, jnp.zeros((3, 2, 5), jnp.float32), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="do not fit the pool"):
        paged_kv_write(pool, 0, jnp.zeros((3, 3, 4), jnp.float32), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match="do not fit the pool"):
        paged_kv_write(pool, 0, jnp.zeros((3, 2, 4), jnp.bfloat16), np.zeros(3, np.int32))
    with pytest.raises(ValueError, match=r"\(2,\) slots for 3 rows"):
        paged_kv_write(pool, 0, jnp.zeros((3, 2, 4), jnp.float32), np.zeros(2, np.int32))


def test_copy_pages_copies_the_counted_pages_of_one_layer():
    """src[start + j] -> dst[j] for j < count, on the layer named only; padding ids (past
    the pool, negative) and entries past count copy nothing."""
    rng = np.random.default_rng(7)
    pool = rng.standard_normal((3, 10, 4, 2, 8)).astype(np.float32)
    src = np.array([9, 1, 2, 3, 4, 0], np.int32)
    dst = np.array([5, 6, 10, -1, 7], np.int32)  # 10 and -1: padding
    want = pool.copy()
    for j in range(4):  # count 4 from start 1: 1 -> 5, 2 -> 6; 3 and 4 go nowhere
        if 0 <= dst[j] < 10:
            want[2, dst[j]] = pool[2, src[1 + j]]
    got = jax.jit(paged_copy_pages)(jnp.asarray(pool), 2, src, 1, dst, 4)
    np.testing.assert_array_equal(np.asarray(got), want)
