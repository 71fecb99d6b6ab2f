"""The packed-weight GEMM (an XLA FFI call) equals numpy's float64 product of the same layer
for every kernel (AVX-512, AVX2, plain vectors), row count, panel remainder and K block;
packing round-trips; the gated form equals numpy's silu(x @ gate) * (x @ up), the rotary
form numpy's RoPE of the product's Q and K, stored apart from V; the gated and QKV forms
normed inside the call equal numpy's RMSNorm, then product; what it cannot do is refused by
name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels.cpu_gemm import (
    PANEL,
    RmsNorm,
    Rope,
    pack_gated,
    pack_weight,
    packed_gemm_available,
    packed_matmul,
    packed_matmul_xla,
    packed_qkv,
    unpack_weight,
)

pytestmark = pytest.mark.skipif(not packed_gemm_available()[0],
                                reason=f"packed GEMM: {packed_gemm_available()[1]}")

RNG = np.random.default_rng(0)
ISAS = ["", "avx2", "generic"]  # "": the host's widest kernel
_matmul = jax.jit(packed_matmul, static_argnums=3)
_gated = jax.jit(lambda x, wp, layer, n, rows=None: packed_matmul(x, wp, layer, n, rows,
                                                                 gated=True),
                 static_argnums=3)


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


def _check(x, w, layer, isa, monkeypatch):
    monkeypatch.setenv("CONFLUX_GEMM_ISA", isa)  # read by the handler on every call
    n = w.shape[-1]
    got = np.asarray(_matmul(x, jnp.asarray(pack_weight(w)), jnp.int32(layer), n))
    want = x.astype(np.float64) @ w[layer].astype(np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(x.shape[-1]))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "k", "n"), [
    ((1,), 48, 32), ((7,), 48, 70), ((16,), 300, 96), ((2, 9), 64, 5), ((0,), 16, 32),
    ((33,), 520, 64),  # three K blocks (256 rows each), row tiles of 8 and a remainder
    # AVX2 runs up to 16 rows as 3-row tiles of the whole panel, more as 6-row half-panels
])
def test_matches_numpy_for_every_layer_and_kernel(rows, k, n, isa, monkeypatch):
    w = _rand(3, k, n)
    x = _rand(*rows, k)
    for layer in range(3):
        _check(x, w, layer, isa, monkeypatch)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 150),
       isa=st.sampled_from(ISAS))
def test_random_shapes(m, k, n, isa):
    with pytest.MonkeyPatch.context() as mp:
        _check(_rand(m, k), _rand(2, k, n), 1, isa, mp)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("live", [0, 1, 9, 20, 24, 30])
def test_live_rows_only(live, isa, monkeypatch):
    """With ``rows``, the first rows are the product and the padding rows after them are
    zero, whatever x holds there (NaN included); a count past M means all of them."""
    monkeypatch.setenv("CONFLUX_GEMM_ISA", isa)
    w, x = _rand(2, 70, 45), _rand(3, 8, 70)  # 24 rows over two leading axes
    x.reshape(24, 70)[min(live, 24):] = np.nan
    got = np.asarray(_matmul(x, jnp.asarray(pack_weight(w)), jnp.int32(1), 45,
                             jnp.int32(live)))
    assert got.shape == (3, 8, 45)
    flat = got.reshape(24, 45)
    want = x.reshape(24, 70)[:live].astype(np.float64) @ w[1].astype(np.float64)
    np.testing.assert_allclose(flat[:live], want, rtol=2e-5, atol=2e-4)
    np.testing.assert_array_equal(flat[live:], 0.0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("block_kib", ["1", "25", "0"])
def test_row_blocks(block_kib, isa, monkeypatch):
    """Rows taken in blocks (``$CONFLUX_GEMM_XBLOCK_KB``; 1 KiB: 8-row blocks, 25: three
    blocks of 24 and a short one, 0: one block) give the same product, partial panel and
    several K blocks included."""
    monkeypatch.setenv("CONFLUX_GEMM_XBLOCK_KB", block_kib)
    w, x = _rand(2, 300, 70), _rand(75, 300)  # 75 x 300 floats: 88 KiB of x
    _check(x, w, 1, isa, monkeypatch)
    _check(x[:5], w, 0, isa, monkeypatch)  # fewer rows than one block


def test_row_blocks_chosen_by_the_host(monkeypatch):
    """The host's own blocks (from its L2 size, at least 128 rows) at a size past any L2."""
    monkeypatch.delenv("CONFLUX_GEMM_XBLOCK_KB", raising=False)
    w, x = _rand(1, 1536, 40), _rand(1200, 1536)  # 7 MiB of x: past L2, blocked
    _check(x, w, 0, "", monkeypatch)


def test_one_matrix_and_the_jnp_form():
    """A 3-D packed matrix (the LM head) is layer 0; packed_matmul_xla is the same product."""
    x, w = _rand(5, 40), _rand(40, 100)
    wp = jnp.asarray(pack_weight(w))
    assert wp.shape == (4, 40, PANEL)
    np.testing.assert_allclose(np.asarray(packed_matmul(x, wp, 0, 100)), x @ w,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(packed_matmul_xla(x, wp, 0, 100)), x @ w,
                               rtol=1e-5, atol=1e-5)


def test_packing_round_trips_with_zero_padding():
    w = _rand(2, 3, 70)
    wp = pack_weight(w)
    assert wp.shape == (2, 3, 3, PANEL)
    np.testing.assert_array_equal(unpack_weight(wp, 70), w)
    np.testing.assert_array_equal(np.asarray(unpack_weight(jnp.asarray(wp), 70)), w)
    np.testing.assert_array_equal(wp[:, 2, :, 70 - 2 * PANEL:], 0)
    np.testing.assert_array_equal(wp[0, 1, 2], w[0, 2, PANEL:2 * PANEL])


def test_inside_a_layer_scan_reads_each_layer():
    """The decoder's use: the stack a loop constant, the layer the scanned index."""
    w = _rand(4, 32, 32) * 0.2
    wp = jnp.asarray(pack_weight(w))
    h0 = _rand(6, 32)

    def body(h, layer):
        return jnp.tanh(packed_matmul(h, wp, layer, 32)), None

    got = jax.jit(lambda h: jax.lax.scan(body, h, jnp.arange(4, dtype=jnp.int32))[0])(h0)
    want = h0
    for layer in range(4):
        want = np.tanh(want @ w[layer])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_a_layer_out_of_range_fails_the_call():
    wp = jnp.asarray(pack_weight(_rand(2, 8, 32)))
    with pytest.raises(Exception, match="layer out of range"):
        np.asarray(_matmul(_rand(3, 8), wp, jnp.int32(2), 32))


def test_what_it_cannot_do_is_refused():
    wp = jnp.asarray(pack_weight(_rand(2, 8, 40)))
    with pytest.raises(ValueError, match="fp32 only"):
        packed_matmul(jnp.ones((2, 8), jnp.bfloat16), wp, 0, 40)
    with pytest.raises(ValueError, match="w contracts 8"):
        packed_matmul(_rand(2, 9), wp, 0, 40)
    with pytest.raises(ValueError, match="do not fill 2 panels"):
        packed_matmul(_rand(2, 8), wp, 0, 70)
    with pytest.raises(ValueError, match="must be packed"):
        packed_matmul(_rand(2, 8), jnp.ones((2, 8, 40)), 0, 40)


def _silu_mul_oracle(x, gate, up):
    """numpy, float64: (silu(x @ gate) * (x @ up), a bound on an fp32 product's error from
    its sums' rounding: ~1e-6 of each sum's absolute terms, carried through silu * up)."""
    x64, g64, u64 = (a.astype(np.float64) for a in (x, gate, up))
    g, u = x64 @ g64, x64 @ u64
    silu = g * np.exp(-np.logaddexp(0.0, -g))  # sigmoid without overflow
    g_err, u_err = 1e-6 * (abs(x64) @ abs(g64)), 1e-6 * (abs(x64) @ abs(u64))
    return silu * u, 1.1 * abs(u) * g_err + abs(silu) * u_err  # |silu'| <= 1.1


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("m", "k", "n", "block_kib"), [
    (1, 48, 32, ""), (16, 300, 96, ""), (33, 520, 70, ""),  # partial last panel, 3 K blocks
    (75, 300, 45, "25"),  # row blocks of 24 and a short one
])
def test_gated_matches_numpy(m, k, n, block_kib, isa, monkeypatch):
    """The gated handler on ``pack_gated``'s interleaved panels, for every layer and kernel,
    large gate values of both signs included (SiLU's tails: -> 0 and -> x)."""
    monkeypatch.setenv("CONFLUX_GEMM_ISA", isa)
    monkeypatch.setenv("CONFLUX_GEMM_XBLOCK_KB", block_kib)
    gate, up, x = _rand(2, k, n), _rand(2, k, n), _rand(m, k)
    gate[:, :, :3] *= 40.0  # pre-activations in the hundreds: exp's clamp and underflow
    wp = jnp.asarray(pack_gated(gate, up))
    assert wp.shape == (2, 2 * -(-n // PANEL), k, PANEL)
    for layer in range(2):
        got = np.asarray(_gated(x, wp, jnp.int32(layer), n))
        want, err = _silu_mul_oracle(x, gate[layer], up[layer])
        assert got.shape == want.shape
        assert (abs(got - want) <= err + 1e-6 * abs(want) + 1e-30).all()


def test_gated_live_rows_and_the_jnp_form():
    """Padding rows come out zero (NaN in x included); packed_matmul_xla's gated form is the
    same product."""
    gate, up, x = _rand(40, 70), _rand(40, 70), _rand(9, 40)
    x[6:] = np.nan
    wp = jnp.asarray(pack_gated(gate, up))
    got = np.asarray(_gated(x, wp, jnp.int32(0), 70, jnp.int32(6)))
    want, err = _silu_mul_oracle(x[:6], gate, up)
    assert (abs(got[:6] - want) <= err + 1e-6 * abs(want) + 1e-30).all()
    np.testing.assert_array_equal(got[6:], 0.0)
    by_xla = np.asarray(packed_matmul_xla(x[:6], wp, 0, 70, gated=True))
    assert (abs(by_xla - want) <= err + 1e-6 * abs(want) + 1e-30).all()


def test_gated_shapes_are_checked():
    wp = jnp.asarray(pack_gated(_rand(8, 40), _rand(8, 40)))  # 2 x 2 panels
    with pytest.raises(ValueError, match="do not fill 4 panels of 32 \\(gated"):
        packed_matmul(_rand(2, 8), wp, 0, 70, gated=True)
    with pytest.raises(ValueError, match="one shape"):
        pack_gated(_rand(8, 40), _rand(8, 41))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("m", "k", "n", "live"), [(1, 48, 32, 1), (16, 300, 70, 16),
                                                   (33, 520, 96, 20)])
def test_residual_is_summed_in_place(m, k, n, live, isa, monkeypatch):
    """residual + x @ w (numpy's float64 sum as the oracle), partial panel and K blocks
    included; rows past ``rows`` keep the residual; inside a jit the residual's buffer
    becomes the result (no copy of it)."""
    monkeypatch.setenv("CONFLUX_GEMM_ISA", isa)
    w, x, res = _rand(2, k, n), _rand(m, k), _rand(m, n)
    x[live:] = np.nan
    fn = jax.jit(lambda x, wp, r: packed_matmul(x, wp, 1, n, live, residual=r),
                 donate_argnums=2)
    wp, r = jnp.asarray(pack_weight(w)), jnp.asarray(res)
    hlo = fn.lower(x, wp, r).compile().as_text()
    got = np.asarray(fn(x, wp, r))
    assert r.is_deleted() and f"f32[{m},{n}]{{1,0}} copy(" not in hlo
    want = res.astype(np.float64)
    want[:live] += x[:live].astype(np.float64) @ w[1].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(k))
    with pytest.raises(ValueError, match="the residual must be f32"):
        packed_matmul(x, wp, 1, n, residual=jnp.zeros((m, n + 1)))


def _rotated(y: np.ndarray, angles: np.ndarray, columns: int) -> np.ndarray:
    """numpy float64 RoPE, rotate-half form, of y's first ``columns`` columns (heads of
    2 * angles.shape[-1]), as transformers' Llama applies it."""
    y = y.astype(np.float64).copy()
    half = angles.shape[-1]
    c, s = np.cos(angles), np.sin(angles)
    for h0 in range(0, columns, 2 * half):
        a, b = y[..., h0:h0 + half].copy(), y[..., h0 + half:h0 + 2 * half].copy()
        y[..., h0:h0 + half] = a * c - b * s
        y[..., h0 + half:h0 + 2 * half] = b * c + a * s
    return y


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("m", "k", "d", "heads", "live", "rotate"), [
    (1, 64, 64, (2, 1, 1), 1, True), (9, 96, 64, (3, 1, 1), 7, True),
    (16, 576, 64, (9, 3, 3), 16, True), (40, 128, 128, (2, 1, 1), 33, True),
    (300, 70, 64, (1, 1, 1), 290, True),  # row blocks below 8 KiB of x
    (12, 40, 32, (3, 2, 2), 12, False)])  # heads of 32: apart, not rotated
def test_qkv_apart_and_rotated_match_numpy(m, k, d, heads, live, rotate, isa, monkeypatch):
    """Q, K and V are the product's column ranges, Q and K rotated by each row's angles
    (numpy float64 RoPE), V as it is, padding rows zero; heads of 64 and 128, the two
    halves of a head in one thread's panel range or split over two (9 + 3 heads of 64:
    30 panels, halves 15 | 15)."""
    monkeypatch.setenv("CONFLUX_GEMM_ISA", isa)
    monkeypatch.setenv("CONFLUX_GEMM_XBLOCK_KB", "8")
    widths = tuple(h * d for h in heads)
    n = sum(widths)
    w, x = _rand(2, k, n), _rand(m, k)
    angles = RNG.integers(0, 4096, (m, 1)) * (1.0 / 10000 ** (np.arange(d // 2) / (d // 2)))
    rope = Rope(jnp.asarray(np.cos(angles), jnp.float32),
                jnp.asarray(np.sin(angles), jnp.float32)) if rotate else None
    got = jax.jit(lambda x, wp: packed_qkv(x, wp, 1, widths, live, rope))(
        x, jnp.asarray(pack_weight(w)))
    want = x.astype(np.float64) @ w[1].astype(np.float64)
    if rotate:
        want = _rotated(want, angles, widths[0] + widths[1])
    want[live:] = 0.0
    bounds = np.cumsum(widths)[:-1]
    for part, expected in zip(got, np.split(want, bounds, axis=-1), strict=True):
        np.testing.assert_allclose(np.asarray(part), expected, rtol=2e-5,
                                   atol=2e-5 * np.sqrt(k))
    if rotate:  # the jnp form of the rotation, the same oracle
        jnp_form = rope.apply(jnp.asarray(x @ w[1])[:, :widths[0] + widths[1]])
        np.testing.assert_allclose(np.asarray(jnp_form)[:live],
                                   want[:live, :widths[0] + widths[1]], rtol=2e-5,
                                   atol=2e-5 * np.sqrt(k))


def test_qkv_shapes_are_checked():
    x, wp = jnp.zeros((4, 32)), jnp.asarray(pack_weight(_rand(1, 32, 256)))
    tables = jnp.zeros((4, 32))
    with pytest.raises(ValueError, match="whole heads"):
        packed_qkv(x, wp, 0, (96, 96, 64), rope=Rope(tables, tables))  # 1.5 heads of 64
    with pytest.raises(ValueError, match="whole panels"):
        packed_qkv(x, wp, 0, (128, 64, 64), rope=Rope(tables[:, :16], tables[:, :16]))
    with pytest.raises(ValueError, match="cos and sin"):
        packed_qkv(x, wp, 0, (128, 64, 64), rope=Rope(tables[:3], tables[:3]))
    with pytest.raises(ValueError, match="multiples of 32"):
        packed_qkv(x, wp, 0, (176, 40, 40))


def _rms_normed(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    """numpy float64 RMSNorm of x's rows (transformers' Llama RMSNorm)."""
    x = x.astype(np.float64)
    return g.astype(np.float64) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("m", "k", "live"), [
    (1, 64, 1), (16, 96, 13), (300, 70, 290),
    (300, 512, 290)])  # rows enough to norm on the workers too (2+ cores)
def test_norm_inside_the_gated_and_qkv_products(m, k, live, isa, monkeypatch):
    """The gated and QKV forms on x's rows RMS-normed by the layer's weight equal numpy's
    float64 norm, then product (gated: then SwiGLU); padding rows stay zero whatever x
    holds there (NaN included), one matrix takes a 1-D weight."""
    monkeypatch.setenv("CONFLUX_GEMM_ISA", isa)
    eps, n = 1e-5, 64
    x = 3.0 * _rand(m, k)
    x[live:] = np.nan
    g = 1.0 + 0.5 * _rand(2, k)
    gate, up, w = _rand(2, k, n), _rand(2, k, n), _rand(2, k, 3 * n)
    normed = _rms_normed(x[:live], g[1], eps)
    got = np.asarray(jax.jit(lambda x, wp, g: packed_matmul(
        x, wp, 1, n, live, gated=True, norm=RmsNorm(g, eps)))(
        x, jnp.asarray(pack_gated(gate, up)), jnp.asarray(g)))
    a, b = normed @ gate[1].astype(np.float64), normed @ up[1].astype(np.float64)
    want = np.zeros((m, n))
    want[:live] = a / (1.0 + np.exp(-a)) * b
    np.testing.assert_allclose(got, want, rtol=5e-5, atol=5e-5 * np.sqrt(k))
    parts = jax.jit(lambda x, wp, g: packed_qkv(x, wp, 1, (n, n, n), live,
                                                norm=RmsNorm(g, eps)))(
        x, jnp.asarray(pack_weight(w)), jnp.asarray(g))
    want = np.zeros((m, 3 * n))
    want[:live] = normed @ w[1].astype(np.float64)
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in parts], -1), want,
                               rtol=5e-5, atol=5e-5 * np.sqrt(k))
    one = packed_qkv(jnp.asarray(x), jnp.asarray(pack_weight(w[1])), 0, (n, n, n), live,
                     norm=RmsNorm(jnp.asarray(g[1]), eps))
    np.testing.assert_allclose(np.concatenate([np.asarray(p) for p in one], -1), want,
                               rtol=5e-5, atol=5e-5 * np.sqrt(k))


def test_norm_shapes_are_checked():
    x, g = jnp.zeros((4, 32)), jnp.ones((2, 32))
    with pytest.raises(ValueError, match="gated product"):
        packed_matmul(x, jnp.asarray(pack_weight(_rand(2, 32, 64))), 0, 64,
                      norm=RmsNorm(g, 1e-5))
    with pytest.raises(ValueError, match=r"f32\[2, 32\]"):
        packed_qkv(x, jnp.asarray(pack_weight(_rand(2, 32, 96))), 0, (32, 32, 32),
                   norm=RmsNorm(g[:1], 1e-5))
