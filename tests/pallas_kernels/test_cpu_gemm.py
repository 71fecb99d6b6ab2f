"""OpenBLAS's stacked GEMM (an XLA FFI call) equals numpy's product of the same layer, in and
out of a layer scan; what it cannot do is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu_gemm import stacked_matmul, stacked_matmul_xla
from pallas_kernels.cpu_gemm.stacked_gemm import _SOURCE, build_handler

RNG = np.random.default_rng(0)


def _rand(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("rows", [(1,), (7,), (2, 5), (0,)])
@pytest.mark.parametrize("transpose_w", [False, True])
def test_matches_numpy_for_every_layer(rows, transpose_w):
    x = _rand(*rows, 48)
    w = _rand(3, 24, 48) if transpose_w else _rand(3, 48, 24)
    fn = jax.jit(stacked_matmul, static_argnums=3)
    for layer in range(3):
        want = x @ (w[layer].T if transpose_w else w[layer])
        got = np.asarray(fn(x, w, jnp.int32(layer), transpose_w))
        assert got.shape == (*rows, 24)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(stacked_matmul_xla(x, w, layer, transpose_w)),
                                   want, rtol=1e-5, atol=1e-5)


def test_inside_a_layer_scan_reads_each_layer():
    """The decoder's use: the stack a loop constant, the layer the scanned index."""
    w = _rand(4, 32, 32) * 0.2
    h0 = _rand(6, 32)

    def run(mm):
        def body(h, layer):
            return jnp.tanh(mm(h, w, layer)), None
        return jax.jit(lambda h: jax.lax.scan(body, h, jnp.arange(4, dtype=jnp.int32))[0])

    want = h0
    for layer in range(4):
        want = np.tanh(want @ w[layer])
    np.testing.assert_allclose(np.asarray(run(stacked_matmul)(h0)), want, rtol=1e-5, atol=1e-5)


def test_a_layer_out_of_range_fails_the_call():
    with pytest.raises(Exception, match="layer index out of range"):
        np.asarray(jax.jit(stacked_matmul)(_rand(2, 8), _rand(3, 8, 4), jnp.int32(3)))


def test_what_it_cannot_do_is_refused():
    with pytest.raises(ValueError, match="fp32 only"):
        stacked_matmul(jnp.ones((2, 8), jnp.bfloat16), jnp.ones((3, 8, 4), jnp.bfloat16), 0)
    with pytest.raises(ValueError, match="must be f32"):
        stacked_matmul(jnp.ones((2, 8)), jnp.ones((8, 4)), 0)
    with pytest.raises(ValueError, match="contracts 8"):
        stacked_matmul(jnp.ones((2, 5)), jnp.ones((3, 8, 4)), 0)


def test_a_missing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-c++"))
    with pytest.raises(RuntimeError, match="cannot run the C\\+\\+ compiler"):
        build_handler(_SOURCE, tmp_path / "out.so", [], str(tmp_path), "m")
    assert not (tmp_path / "out.so").exists()


def test_openblas_workers_sleep_between_calls():
    """Idle OpenBLAS workers would spin ~0.1 s after every call, taking the cores from
    XLA's threads between the step's GEMMs; they are set to sleep at once."""
    import os
    import time

    fn = jax.jit(stacked_matmul)
    x, w = _rand(16, 256), _rand(1, 256, 512)
    fn(x, w, jnp.int32(0)).block_until_ready()
    burnt = []
    for _ in range(3):
        fn(x, w, jnp.int32(0)).block_until_ready()
        before = os.times()
        time.sleep(0.1)
        after = os.times()
        burnt.append(after.user + after.system - before.user - before.system)
    assert os.environ["OPENBLAS_THREAD_TIMEOUT"] == "4"
    assert min(burnt) < 0.03, burnt  # a spinning worker would burn ~0.1 s of CPU here
