"""The spinning workers the CPU handlers split their calls over (``cpu_parallel.cc``): every
part of a split call runs once (the products equal numpy's), calls from several threads at
once are right too (the one that finds the workers busy falls back to XLA's pool), the GEMM
and attention handlers share one set of workers, and idle workers sleep."""

import os
import resource
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.cpu_attention import paged_attention_available, paged_decode
from pallas_kernels.cpu_gemm import pack_weight, packed_gemm_available, packed_matmul
from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention

pytestmark = pytest.mark.skipif(
    not (packed_gemm_available()[0] and paged_attention_available()[0]),
    reason=f"CPU handlers: {packed_gemm_available()[1]} {paged_attention_available()[1]}")

_matmul = jax.jit(packed_matmul, static_argnums=3)


def _gemm_case(seed: int, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((2, k, n)).astype(np.float32))


def _check_gemm(x: np.ndarray, w: np.ndarray, wp: jax.Array) -> None:
    got = np.asarray(_matmul(x, wp, jnp.int32(1), w.shape[-1]))
    want = x.astype(np.float64) @ w[1].astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.sqrt(x.shape[-1]))


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_split_gemm_matches_and_calls_from_threads_at_once_too():
    """Shapes past the split threshold (64 x 512 x 1024: as many parts as cores), called
    repeatedly from four Python threads at once (JAX runs calls without the GIL)."""
    cases = [_gemm_case(s, m, 512, n) for s, (m, n) in enumerate([(64, 1024), (40, 800),
                                                                  (96, 640), (17, 1056)])]
    packed = [jnp.asarray(pack_weight(w)) for _, w in cases]
    for (x, w), wp in zip(cases, packed, strict=True):
        _check_gemm(x, w, wp)  # compiled once per shape, before the threads start
    errors: list[BaseException] = []

    def hammer(i: int) -> None:
        try:
            for _ in range(15):
                _check_gemm(*cases[i], packed[i])
        except BaseException as e:  # noqa: BLE001 (reported by the main thread)
            errors.append(e)

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_gemm_and_attention_share_the_workers():
    """After a split GEMM made the workers, a split attention call adds no thread."""
    x, w = _gemm_case(7, 64, 512, 1024)
    _check_gemm(x, w, jnp.asarray(pack_weight(w)))
    before = _threads()
    rng = np.random.default_rng(3)
    lens = [500, 260, 511, 333]  # past 512 keys in all: split by KV length
    pages = 160
    q = rng.standard_normal((4, 6, 32)).astype(np.float32)
    k = rng.standard_normal((pages, 16, 2, 32)).astype(np.float32)
    v = rng.standard_normal((pages, 16, 2, 32)).astype(np.float32)
    table = rng.permutation(pages)[: 4 * 32].reshape(4, 32).astype(np.int32)
    kv_lens = np.asarray(lens, np.int32)
    got = np.asarray(paged_decode(q, k, v, kv_lens, table, np.int32(4), 0.2))
    want = ref_ragged_paged_attention(q, k, v, kv_lens, table,
                                      np.arange(5, dtype=np.int32), np.int32(4), sm_scale=0.2)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    assert _threads() == before


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_idle_workers_sleep():
    """A while after the last call the workers are parked: the process burns no CPU idle
    (they spin $CONFLUX_SPIN_US, 5 ms by default, after each call)."""
    x, w = _gemm_case(9, 64, 512, 1024)
    _check_gemm(x, w, jnp.asarray(pack_weight(w)))
    time.sleep(0.2)
    start = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(0.5)
    end = resource.getrusage(resource.RUSAGE_SELF)
    used = (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)
    assert used < 0.1, f"{used:.3f} s of CPU in 0.5 s idle"
