"""The accelerator path, checked on CPU: the whole step with the Pallas attention kernel (in
interpret mode) against the dense reference, and the whole step lowered for CUDA (Triton)
and for TPU without a device, so lowering errors in context show up here."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
import pytest
from conflux_workload import run_random_workload
from pretend_tpu import pretend_tpu
from tiny_models import TINY_LLAMA, TINY_SMOL

import pallas_kernels._common as kernel_common
from conflux_jax.executor.batch import StepBatch
from conflux_jax.executor.buckets import BucketConfig, StepShape
from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
from conflux_jax.models.decoder import random_params
from pallas_kernels.ragged_paged_attention import pallas as rpa_pallas_mod

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

# SmolLM2's 9/3 heads (padded to 12/4 at sp=4) with the Pallas kernel's smallest head dim.
SMOL16 = TINY_SMOL.replace(head_dim=16)
# One token bucket and one transfer bucket: three executables (the interpreted kernel makes
# each compile slow).
BUCKETS = BucketConfig(tokens=(16,), decode=(8,), decode_pages=(16,), transfer=(4,),
                       max_prefill_seqs=3)
CASES = {  # name: (config, mesh)
    "padded-heads-sp4": (SMOL16, "sp=4,tp=1"),
    "llama-sp2-tp2": (TINY_LLAMA, "sp=2,tp=2"),
    # 3 KV heads padded to 4 = sp*tp: padding heads, Ulysses SP and base TP at once
    "padded-heads-sp2-tp2": (SMOL16, "sp=2,tp=2"),
}


def _executor(config: Any, mesh: str, impl: str, **kw: Any) -> tuple[JaxExecutor, Any]:
    params = random_params(config, seed=5, scale=0.2)
    ec = ExecutorConfig(mesh=mesh, page_size=4, num_pages=48, max_model_len=64,
                        buckets=BUCKETS, attention_impl=impl, **kw)
    return JaxExecutor(config, params, ec), params


def test_step_with_the_pallas_kernel_matches_reference(monkeypatch) -> None:
    """Prefill (chunked, several at once), the KV transfer and decode, through the stacked
    pool, the layer page offsets and the prefill view, with the kernel interpreted; on a
    mesh with SP, TP and padded heads (one case: each interpreted compile takes seconds)."""
    config, mesh = CASES["padded-heads-sp2-tp2"]
    calls: list[bool] = []
    kernel = rpa_pallas_mod.rpa_pallas

    def spy(*args: Any, interpret: bool, **kwargs: Any) -> Any:
        calls.append(interpret)
        return kernel(*args, interpret=interpret, **kwargs)

    monkeypatch.setattr(rpa_pallas_mod, "rpa_pallas", spy)
    ex, params = _executor(config, mesh, "interpret", return_logits=True)
    assert ex.step_config.model.num_kv_heads == 4 > config.num_kv_heads  # padded heads
    shapes: list[StepShape] = []
    execute = ex.execute

    def record(plan):  # noqa: ANN001, ANN202
        shapes.append(ex.build_batch(plan)[0])
        return execute(plan)

    ex.execute = record  # type: ignore[method-assign]
    stats = run_random_workload(ex, params, np.random.default_rng(11), num_requests=3,
                                max_prompt=20, max_output=3)
    assert stats["checked"] >= 3
    assert calls and all(calls)  # every attention of every compiled step: the kernel
    assert any(s.transfer for s in shapes) and any(s.prefill and s.decode for s in shapes)


def _lower(ex: JaxExecutor, shape: StepShape, platform: str) -> str:
    """The step's forward and sampler lowered for ``platform``: both must lower."""
    rows = StepBatch.sample_rows(shape, ex.layout)
    return "\n".join(
        fn.trace(*args).lower(lowering_platforms=(platform,)).as_text()
        for fn, args in ((ex._step.forward, ex._abstract_args(shape)),
                         (ex._step.sample, ex._abstract_sample_args(rows))))


@pytest.mark.parametrize("case", list(CASES))
def test_whole_step_lowers_for_cuda(case: str, monkeypatch) -> None:
    """The step with the compiled kernel (impl="pallas") lowers to Triton for CUDA from this
    CPU machine, the KV transfer and the prefix-cache loads as ragged all-to-alls (no
    gather to every rank)."""
    monkeypatch.setattr(kernel_common, "on_gpu", lambda: True)  # allow impl="pallas" here
    config, mesh = CASES[case]
    ex, _ = _executor(config, mesh, "pallas")
    mixed = ex.planner.shape_for(prefill_max=6, decode_max=2, combined_max=8,
                                 decode_pages_max=4, transfer_max=3)
    assert mixed.prefill and mixed.decode and mixed.transfer
    decode_only = ex.planner.shape_for(0, 3, 3, 4)
    text = _lower(ex, mixed, "cuda")
    assert "triton" in text and "all_gather" not in text
    # K and V of the transfer and of the prefix-cache loads: all ragged (only live pages)
    assert text.count("ragged_all_to_all") == 4, text.count("ragged_all_to_all")
    text = _lower(ex, decode_only, "cuda")
    assert "triton" in text and "all_to_all" not in text  # decode stays on its rank


def test_per_layer_weights_lower_for_cuda(monkeypatch) -> None:
    """The accelerators' default layout (each layer's weights its own arrays, the layers
    unrolled) lowers for CUDA on a mesh with SP, TP and padded heads: each layer its own
    kernel calls and ragged transfers."""
    monkeypatch.setattr(kernel_common, "on_gpu", lambda: True)
    config, mesh = CASES["padded-heads-sp2-tp2"]
    ex, _ = _executor(config, mesh, "pallas", layer_weights="per_layer")
    mixed = ex.planner.shape_for(prefill_max=6, decode_max=2, combined_max=8,
                                 decode_pages_max=4, transfer_max=3)
    text = _lower(ex, mixed, "cuda")
    assert "triton" in text and "all_gather" not in text
    assert text.count("ragged_all_to_all") == 4 * config.num_layers


def test_one_rank_moves_kv_without_a_collective(monkeypatch) -> None:
    """On a one-rank mesh the KV transfer and the prefix-cache loads are local gathers:
    the step lowered for CUDA has no all-to-all of any kind (XLA:GPU ran a ragged one over
    a single device as a kernel of its own, ~0.5 ms per layer and pool on an H200)."""
    monkeypatch.setattr(kernel_common, "on_gpu", lambda: True)
    ex, _ = _executor(TINY_LLAMA, "sp=1,tp=1", "pallas")
    mixed = ex.planner.shape_for(prefill_max=6, decode_max=2, combined_max=8,
                                 decode_pages_max=4, transfer_max=3)
    assert mixed.prefill and mixed.decode and mixed.transfer
    text = _lower(ex, mixed, "cuda")
    assert "triton" in text and "all_to_all" not in text
    # Each local move (K and V, transfer and load) is its own buffer before it is scattered
    # back into the pool: fused, gather and scatter would share the pool and XLA:GPU would
    # copy all of it first (an H200 profile: ~100 pool-sized copies a step).
    assert text.count("optimization_barrier") == 4, text.count("optimization_barrier")


def test_whole_step_lowers_for_tpu() -> None:
    """Without a TPU the step lowers for TPU with the jnp attention path: the collectives,
    the ragged transfer and the in-place pool updates are all expressible there. (The
    Triton kernel is GPU-only.)"""
    ex, _ = _executor(SMOL16, "sp=4,tp=1", "xla")
    mixed = ex.planner.shape_for(6, 2, 8, 4, transfer_max=3)
    text = _lower(ex, mixed, "tpu")
    assert "ragged_all_to_all" in text and "all_gather" not in text


def test_step_with_the_combined_pool_matches_reference() -> None:
    """One K/V pool, K and V of each head side by side (JAX's TPU kernel's layout), through
    the whole step: chunked prefills, the KV transfer and decode, on a mesh with SP, TP and
    padded heads, against the dense reference (attention by the XLA path on its views)."""
    config, mesh = CASES["padded-heads-sp2-tp2"]
    ex, params = _executor(config, mesh, "xla", kv_layout="combined", return_logits=True)
    (pool,) = ex.kv_pools
    assert pool.shape[4] == 2 * ex.step_config.model.num_kv_heads
    assert ex.decode_attention == ex.prefill_attention == "rpa"  # the CPU handlers read split
    stats = run_random_workload(ex, params, np.random.default_rng(12), num_requests=4,
                                max_prompt=20, max_output=3)
    assert stats["checked"] >= 4


@pytest.mark.parametrize(("dtype", "layer_weights"), [
    ("bfloat16", "per_layer"),  # a TPU's defaults: the layers unrolled, a kernel call each
    ("float32", "stacked")])
def test_whole_step_lowers_for_tpu_with_jax_kernel(monkeypatch, dtype: str,
                                                   layer_weights: str) -> None:
    """On a TPU the step picks JAX's own ragged paged attention kernel and the combined pool
    by default, for head dims the kernel takes; the whole step lowers for TPU from this CPU
    host with the Mosaic kernel in its attention (prefill over head shards, decode, the
    owner-alone suffixes) and the transfer as ragged all-to-alls of K/V pairs."""
    pretend_tpu(monkeypatch)  # a v5e, as far as the kernel can tell
    config = TINY_LLAMA.replace(head_dim=128)
    ex, _ = _executor(config, "sp=2,tp=2", None, dtype=dtype, layer_weights=layer_weights)
    assert (ex.attention_impl, ex.kv_layout) == ("tpu", "combined")
    assert ex.kv_pools[0].dtype == dtype
    mixed = ex.planner.shape_for(prefill_max=6, decode_max=2, combined_max=8,
                                 decode_pages_max=4, transfer_max=3)
    text = _lower(ex, mixed, "tpu")
    layers = config.num_layers if layer_weights == "per_layer" else 1  # in the program
    # the kernel at two shapes (prefill over head shards; decode and the suffixes), its
    # bodies shared by every layer ...
    assert text.count("tpu_custom_call") == 2, text.count("tpu_custom_call")
    # ... called for each layer's prefill, decodes and owner-alone suffixes
    assert len(re.findall(r"call @ragged_paged_attention\w*\(", text)) == 3 * layers
    assert "all_gather" not in text
    # one pool: the transfer's and the prefix-cache loads' ragged all-to-alls, once each
    assert text.count("ragged_all_to_all") == 2 * layers, text.count("ragged_all_to_all")


def test_tpu_default_gives_way_where_jax_kernel_cannot_run(monkeypatch, caplog) -> None:
    """SmolLM2's 64-wide heads: on a TPU the default falls back to the XLA path on split
    pools (and says why); the kernel asked for by name is refused with the reason."""
    monkeypatch.setattr(kernel_common, "on_tpu", lambda: True)
    config = TINY_SMOL.replace(head_dim=64)
    ex, _ = _executor(config, "sp=2,tp=2", None)
    assert (ex.attention_impl, ex.kv_layout) == ("xla", "split")
    assert "multiple of 128" in caplog.text
    with pytest.raises(ValueError, match="attention_impl='tpu' cannot run.*multiple of 128"):
        _executor(config, "sp=2,tp=2", "tpu")
    with pytest.raises(ValueError, match="kv_layout='split'"):
        _executor(TINY_LLAMA.replace(head_dim=128), "sp=2,tp=2", "tpu", kv_layout="split")
