"""The host floor: shapes counted from the real params, the floor the larger of its parts."""

import numpy as np
import pytest
from tiny_models import TINY_LLAMA

from conflux_jax.bench.host_floor import ISA_FLAGS, host_floor, step_matrices
from conflux_jax.models.decoder import random_params

LINEARS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def test_step_matrices_are_the_models_linears_and_lm_head():
    params = random_params(TINY_LLAMA, seed=0)
    # Oracle: every matrix the params hold that a decode step multiplies by.
    head = params["lm_head"] if "lm_head" in params else params["embed"]
    want = sum(np.asarray(params["layers"][k]).size for k in LINEARS) + np.asarray(head).size
    assert sum(c * k * n for c, k, n in step_matrices(TINY_LLAMA)) == want


@pytest.mark.parametrize("rows", [1, 4])
def test_floor_is_the_larger_of_memory_and_compute(rows):
    f = host_floor(TINY_LLAMA, rows, copy_megabytes=8, repeats=2)
    assert f.rows == rows and set(f.isa) <= set(ISA_FLAGS) and f.cpu
    assert f.weight_bytes == 4 * sum(c * k * n for c, k, n in step_matrices(TINY_LLAMA))
    assert f.flops == 2 * rows * f.weight_bytes // 4
    assert f.memory_s == pytest.approx(f.weight_bytes / (f.copy_gbs * 1e9))
    assert f.sgemm_gflops == pytest.approx(f.flops / f.compute_s / 1e9)
    assert f.floor_s == max(f.memory_s, f.compute_s) > 0


def test_compute_takes_the_faster_gemm_per_shape(monkeypatch):
    """Per matrix shape, the faster of numpy's BLAS and the packed GEMM (timings faked:
    the arithmetic, not the clock, is under test)."""
    import conflux_jax.bench.host_floor as hf

    monkeypatch.setattr(hf, "sgemm_seconds", lambda r, k, n, rep=5: 1e-3 if k < n else 4e-3)
    monkeypatch.setattr(hf, "packed_sgemm_seconds", lambda r, k, n, rep=5: 2e-3)
    f = hf.host_floor(TINY_LLAMA, 4, copy_megabytes=8, repeats=1)
    want = sum(c * (1e-3 if k < n else 2e-3) for c, k, n in step_matrices(TINY_LLAMA))
    assert f.compute_s == pytest.approx(want)


def test_packed_sgemm_is_timed_when_it_runs():
    from conflux_jax.bench.host_floor import packed_sgemm_seconds
    from pallas_kernels.cpu_gemm import packed_gemm_available

    t = packed_sgemm_seconds(4, 64, 96, repeats=2)
    assert (0 < t < 1) if packed_gemm_available()[0] else t == float("inf")


def test_isa_caps_are_the_set_cap_variables_and_xlas_max_isa():
    from conflux_jax.bench.host_floor import isa_caps

    env = {"CONFLUX_GEMM_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4 --xla_cpu_max_isa=AVX2",
           "HOME": "/root"}
    assert isa_caps(env) == {"CONFLUX_GEMM_ISA": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                             "XLA_FLAGS": "--xla_cpu_max_isa=AVX2"}
    assert isa_caps({"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}) == {}
