"""The executor's weights and KV pools on transparent huge pages: spans, advice, values."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import TINY_LLAMA

from conflux_jax.executor.buckets import BucketConfig
from conflux_jax.executor.huge_pages import (
    HUGE_PAGE,
    advise_huge_pages,
    cpu_spans,
    huge_page_span,
)
from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
from conflux_jax.models.decoder import random_params

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's madvise")


@pytest.mark.parametrize("pointer", [0, 64, HUGE_PAGE - 64, HUGE_PAGE, 3 * HUGE_PAGE + 4096])
@pytest.mark.parametrize("nbytes", [0, 4096, HUGE_PAGE, 2 * HUGE_PAGE + 8192, 5 * HUGE_PAGE])
def test_span_is_the_whole_huge_pages_inside_the_buffer(pointer: int, nbytes: int) -> None:
    start, length = huge_page_span(pointer, nbytes)
    # Brute force: every huge page boundary range lying wholly inside the buffer.
    inside = [p for p in range(0, pointer + nbytes + HUGE_PAGE, HUGE_PAGE)
              if p >= pointer and p + HUGE_PAGE <= pointer + nbytes]
    assert length == len(inside) * HUGE_PAGE
    if inside:
        assert start == inside[0]


def _anon_huge_kb(address: int) -> int | None:
    """AnonHugePages (kB) of this process's mapping that holds ``address``."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    hit = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            hit = lo <= address < hi
        elif hit and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return None


@linux
def test_advice_keeps_values_and_collapses_into_huge_pages() -> None:
    host = np.random.default_rng(0).standard_normal(3 * HUGE_PAGE // 4 + 1000, np.float32)
    a = jax.device_put(jnp.asarray(host), jax.devices("cpu")[0])
    a.block_until_ready()
    spans = cpu_spans([a])
    assert len(spans) == 1 and spans[0][1] >= HUGE_PAGE  # a 3 MiB+ buffer holds one at least
    done = advise_huge_pages(spans)
    assert done.advised == spans[0][1]
    np.testing.assert_array_equal(np.asarray(a), host)
    assert float(jnp.sum(a)) == pytest.approx(float(host.sum(dtype=np.float64)), rel=1e-4)
    if done.collapsed:  # MADV_COLLAPSE is Linux 6.1+ and may find no free huge page
        assert (_anon_huge_kb(spans[0][0]) or 0) >= HUGE_PAGE // 1024


def test_small_buffers_are_left_alone() -> None:
    assert cpu_spans([jnp.zeros(1000, jnp.float32)]) == []
    assert advise_huge_pages([]).advised == 0


@linux
def test_executor_advises_its_pools_and_still_computes() -> None:
    params = random_params(TINY_LLAMA, seed=1, scale=0.2)
    ec = ExecutorConfig(mesh="sp=1,tp=1", page_size=4, num_pages=8192, max_model_len=128,
                        buckets=BucketConfig(tokens=(32,), decode=(8,), decode_pages=(32,),
                                             transfer=(8,), max_prefill_seqs=4))
    ex = JaxExecutor(TINY_LLAMA, params, ec)
    advice = ex.huge_pages
    assert advice is not None
    advice.join(timeout=60)
    assert advice.result is not None
    pool_bytes = sum(p.nbytes for p in ex.kv_pools)
    assert advice.result.advised >= pool_bytes - 2 * HUGE_PAGE * len(ex.kv_pools)
    # The pools still hold zeros, at the addresses advised.
    assert all(float(jnp.abs(p).max()) == 0.0 for p in ex.kv_pools)
    starts = {s for s, _ in advice.spans}
    for p in ex.kv_pools:
        start, _ = huge_page_span(p.unsafe_buffer_pointer(), p.nbytes)
        assert start in starts
