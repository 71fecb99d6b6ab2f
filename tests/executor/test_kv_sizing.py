"""The KV pool sized from device memory (vLLM's --gpu-memory-utilization), on CPU with a
forced small "device memory": pages = (utilization * memory - weights - the largest
step's temporaries) / bytes per page, each term computed here by hand."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest
from tiny_models import SMALL_STEP, TINY_LLAMA

from conflux_jax.executor.jax_executor import CPU_NUM_PAGES, ExecutorConfig, JaxExecutor
from conflux_jax.models.decoder import random_params

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

PARAMS = random_params(TINY_LLAMA, seed=1, scale=0.2)
MIB = 1 << 20


def _executor(**kw) -> JaxExecutor:
    return JaxExecutor(TINY_LLAMA, PARAMS, ExecutorConfig(**{**SMALL_STEP, **kw}))


def test_pool_is_what_memory_leaves_after_weights_and_the_largest_step(caplog) -> None:
    m = TINY_LLAMA
    # Weights are replicated over sp: each device holds all of them, in float32.
    weights = sum(np.asarray(a).size for a in jax.tree.leaves(PARAMS)) * 4
    page = 2 * m.num_layers * 4 * m.num_kv_heads * m.head_dim * 4  # K+V, all layers
    with caplog.at_level(logging.INFO, logger="conflux_jax.executor.jax_executor"):
        ex = _executor(gpu_memory_utilization=0.5, device_memory_bytes=8 * MIB)
    mp = ex.memory
    assert mp.weight_bytes == weights and mp.page_bytes == page
    # The temporaries were read from a stand-in pool's compile; the real pool's largest
    # step needs the same (nothing in a step is pool-sized: test_memory_safety.py).
    ex.compile_shape(mp.largest_shape)
    real = ex._compiled[mp.largest_shape].memory_analysis()
    assert 0 < real.temp_size_in_bytes <= mp.activation_bytes < real.temp_size_in_bytes + MIB
    want = (int(0.5 * 8 * MIB) - weights - mp.activation_bytes) // page
    assert ex.kv.num_pages == want and ex.kv_pools[0].shape[2] == want
    assert f"KV cache: {want * 4 * 2} tokens" in caplog.text  # vLLM's start-up line
    assert "max concurrency for 32 tokens per request" in caplog.text

    # Twice the memory: the same weights and temporaries, the rest is pages.
    big = _executor(gpu_memory_utilization=0.5, device_memory_bytes=16 * MIB)
    assert big.memory.activation_bytes == mp.activation_bytes
    assert big.kv.num_pages == (int(0.5 * 16 * MIB) - weights - mp.activation_bytes) // page

    with pytest.raises(ValueError, match="not enough device memory"):
        _executor(gpu_memory_utilization=0.05, device_memory_bytes=8 * MIB)


def test_cpu_keeps_its_page_count_unless_asked() -> None:
    assert _executor().kv.num_pages == CPU_NUM_PAGES
    assert _executor(num_pages=40, gpu_memory_utilization=0.5).kv.num_pages == 40  # wins


def test_linears_the_host_cannot_run_are_refused() -> None:
    # auto on the CPU in fp32: the packed GEMM, its weights packed
    ex = _executor()
    assert ex.step_config.linears == "packed" and ex.params["layers"]["wqkv"].ndim == 4
    assert _executor(linears="blas").step_config.linears == "blas"  # fp32 on the CPU
    with pytest.raises(ValueError, match="linears must be one of"):
        _executor(linears="onednn")
    with pytest.raises(ValueError, match="linears='blas' cannot run: it is fp32 only"):
        _executor(linears="blas", dtype="bfloat16")
    with pytest.raises(ValueError, match="linears='packed' cannot run: it is fp32 only"):
        _executor(linears="packed", dtype="bfloat16")
    if jax.device_count() >= 2:
        with pytest.raises(ValueError, match=r"linears='packed' cannot run: .*tp=1 only"):
            _executor(linears="packed", mesh="sp=1,tp=2")
    # auto falls back to XLA's dot where the packed GEMM cannot run.
    assert _executor(dtype="bfloat16").step_config.linears == "xla"
