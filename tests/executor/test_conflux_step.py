"""The Conflux step and its baseline modes on 4 simulated CPU devices equal the dense
single-device reference; warm-up compiles everything serving needs."""

import jax
import numpy as np
import pytest
from conflux_workload import run_random_workload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import TINY_LLAMA, TINY_QWEN3, TINY_SMOL

from conflux_jax.executor.buckets import BucketConfig
from conflux_jax.executor.compile_guard import compile_count
from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
from conflux_jax.models.decoder import random_params

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

# Few buckets keep compile time low (five shapes; a completing prefill's 1-8 page groups
# all pad to the one transfer bucket); bucket choice itself is unit-tested elsewhere.
BUCKETS = BucketConfig(tokens=(8, 32), decode=(8,), decode_pages=(32,), transfer=(8,),
                       max_prefill_seqs=4)


CPU_LINEARS = "auto"  # on the CPU in fp32: the packed GEMM (tp=1), else XLA's dot
CPU_BLAS = "blas" if jax.default_backend() == "cpu" else "auto"


def make_executor(config, mesh, params, linears=CPU_LINEARS, layer_weights="auto"):
    # With XLA's dot, also the XLA form of attention (else the CPU's FFI handlers).
    attention = "rpa" if linears == "xla" else "auto"
    ec = ExecutorConfig(mesh=mesh, page_size=4, num_pages=96, max_model_len=128,
                        buckets=BUCKETS, return_logits=True, linears=linears,
                        decode_attention=attention, prefill_attention=attention,
                        layer_weights=layer_weights)
    return JaxExecutor(config, params, ec)


# The packed GEMM ("auto" at tp=1) runs the sp meshes, OpenBLAS the tp one; the mixed mesh
# runs XLA's dot, what "auto" takes with tp > 1, and the kernel's XLA form of attention.
# Per-layer weights (the accelerators' default) run unrolled, with TP-sharded weights.
CASES = {  # name: (config, mesh, iteration mode[, linears[, layer weights]]); on CPU
    "llama-sp4": (TINY_LLAMA, "sp=4,tp=1", "conflux"),
    "llama-sp2-tp2-xla-linears": (TINY_LLAMA, "sp=2,tp=2", "conflux", "xla"),
    "qwen3-sp2-tp2-per-layer": (TINY_QWEN3, "sp=2,tp=2", "conflux", "xla", "per_layer"),
    "qwen3-sp4": (TINY_QWEN3, "sp=4,tp=1", "conflux"),
    "smol-padded-sp4": (TINY_SMOL, "sp=4,tp=1", "conflux"),
    "baseline-tp4-chunked": (TINY_LLAMA, "sp=1,tp=4", "conflux", CPU_BLAS),
    "baseline-isolated-sp4": (TINY_QWEN3, "sp=4,tp=1", "isolated"),
}
_executors: dict[tuple, tuple] = {}


def _executor(config, mesh, linears=CPU_LINEARS, layer_weights="auto"):
    key = (config, mesh, linears, layer_weights)
    if key not in _executors:
        params = random_params(config, seed=1, scale=0.2)
        _executors[key] = (make_executor(config, mesh, params, linears, layer_weights),
                           params)
    return _executors[key]


@pytest.mark.parametrize("case", list(CASES))
@settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**31 - 1))
def test_random_mixed_iterations_match_reference(case, seed):
    config, mesh, mode, *linears = CASES[case]
    ex, params = _executor(config, mesh, *linears)
    stats = run_random_workload(ex, params, np.random.default_rng(seed), num_requests=6,
                                max_prompt=40, max_output=6, mode=mode)
    assert stats["checked"] >= 6


def test_single_row_buckets_match_reference():
    """Decode-only steps of one sequence per rank run the 1-row buckets (one-slot KV
    writes, two-item attention groups): still equal to the dense reference."""
    params = random_params(TINY_LLAMA, seed=2, scale=0.2)
    ec = ExecutorConfig(mesh="sp=4,tp=1", page_size=4, num_pages=96, max_model_len=128,
                        buckets=BucketConfig(tokens=(1, 8, 32), decode=(1, 8),
                                             decode_pages=(32,), max_prefill_seqs=4),
                        return_logits=True)
    ex = JaxExecutor(TINY_LLAMA, params, ec)
    shapes = []
    execute = ex.execute

    def spy(plan):
        shapes.append(ex.build_batch(plan)[0])
        return execute(plan)

    ex.execute = spy
    stats = run_random_workload(ex, params, np.random.default_rng(3), num_requests=3,
                                max_prompt=20, max_output=8, mode="conflux")
    assert stats["checked"] >= 3
    assert any(s.tokens == 1 and s.decode == 1 for s in shapes)


def test_no_compilation_after_warmup_across_200_iterations():
    ex, params = _executor(TINY_LLAMA, "sp=4,tp=1")
    ex.warmup(progress=False)
    assert set(ex.planner.all_shapes()) <= set(ex._compiled)
    ex.guard.serving = True
    before = compile_count()
    rng = np.random.default_rng(0)
    iterations = 0
    try:
        while iterations < 200:
            stats = run_random_workload(ex, params, rng, num_requests=8, max_prompt=60,
                                        max_output=12, verify=False)
            iterations += stats["iterations"]
    finally:
        ex.guard.serving = False
    assert compile_count() == before
