"""The compiled step updates the KV pools in place: no pool-sized copy in its HLO, and its
memory analysis shows both pools aliased to the outputs (donated), not doubled.

The pool is made much larger than everything else a step touches, so a copy of it (or a
second pool in temporaries) cannot hide among the bucket-sized buffers.
"""

from __future__ import annotations

import math
import re

import jax
import pytest
from tiny_models import TINY_LLAMA

from conflux_jax.executor.buckets import BucketConfig
from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
from conflux_jax.models.decoder import random_params

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

# An HLO instruction that copies: `%name = f32[1,2,4096,4,2,16]{...} copy(...)`.
_COPY = re.compile(r"=\s*\w+\[([\d,]*)\]\S*\s+copy(?:-start)?\(")


@pytest.mark.parametrize(("mesh", "kv_layout"), [
    ("sp=4,tp=1", "split"), ("sp=2,tp=2", "split"), ("sp=1,tp=1", "split"),
    ("sp=2,tp=2", "combined")])  # the combined pool: JAX's TPU kernel's layout
def test_step_updates_the_pool_in_place(mesh: str, kv_layout: str) -> None:
    params = random_params(TINY_LLAMA, seed=1, scale=0.2)
    ec = ExecutorConfig(mesh=mesh, page_size=4, num_pages=4096, max_model_len=128,
                        buckets=BucketConfig(tokens=(32,), decode=(8,), decode_pages=(32,),
                                             transfer=(8,), max_prefill_seqs=4),
                        kv_layout=kv_layout)
    ex = JaxExecutor(TINY_LLAMA, params, ec)
    assert len(ex.kv_pools) == (1 if kv_layout == "combined" else 2)
    # Where the CPU's handlers attend, they write the KV too: in place is checked for them.
    cpu = "cpu" in (ex.step_config.decode_attention, ex.step_config.prefill_attention)
    assert ex.step_config.kv_write == ("cpu" if cpu else "xla")
    # one device's pools, each f[1, L, pages, ...]; "pool-sized" = one of K or V's size
    local = [pool.addressable_shards[0].data for pool in ex.kv_pools]
    kv_size = sum(a.size for a in local) // 2
    pool_bytes = 2 * kv_size * local[0].dtype.itemsize  # K and V
    shapes = [ex.planner.shape_for(0, 5, 5, 8),  # decode only
              ex.planner.shape_for(20, 5, 25, 8, transfer_max=3)]  # prefill + transfer
    for shape in shapes:
        ex.compile_shape(shape)
        compiled = ex._compiled[shape]
        copies = [math.prod(int(x) for x in dims.split(",") if x)
                  for dims in _COPY.findall(compiled.as_text())]
        assert copies, "no copy instruction parsed: the HLO pattern is stale"
        assert max(copies) < kv_size, f"{shape}: a pool-sized copy"
        mem = compiled.memory_analysis()
        assert mem.alias_size_in_bytes == pool_bytes, f"{shape}: K and V not donated"
        assert mem.temp_size_in_bytes < pool_bytes / 4, f"{shape}: a pool in temporaries"
        assert mem.output_size_in_bytes < pool_bytes * 1.01  # the outputs are the pools


@pytest.mark.parametrize("layer_weights", ["stacked", "per_layer"])
def test_per_layer_weights_reach_the_matmuls_uncopied(layer_weights: str) -> None:
    """Held per layer, every FFN-weight-shaped buffer of the compiled step is an argument:
    no layer's weights are copied before a matmul. Stacked, XLA:CPU copies each layer's
    slice out of the stacked array (what the per-layer layout exists to avoid)."""
    c = TINY_LLAMA
    ec = ExecutorConfig(mesh="sp=1,tp=1", page_size=4, num_pages=64, max_model_len=64,
                        linears="xla", layer_weights=layer_weights,
                        buckets=BucketConfig(tokens=(8,), decode=(8,), decode_pages=(16,),
                                             transfer=(4,), max_prefill_seqs=2))
    ex = JaxExecutor(c, random_params(c, seed=1, scale=0.2), ec)
    assert ex.layer_weights == layer_weights
    # Unrolled layers keep XLA's KV scatter: the CPU handler's in-place write would be
    # handed the step's pool argument and copied around (stacked: see above).
    assert ex.step_config.kv_write == ("xla" if layer_weights == "per_layer" else "cpu")
    for shape in (ex.planner.shape_for(0, 3, 3, 4),  # decode only
                  ex.planner.shape_for(5, 2, 7, 4, transfer_max=2)):  # prefill + transfer
        ex.compile_shape(shape)
        ffn_weight = rf"=\s*f32\[{c.hidden_size},{c.intermediate_size}\]\S*\s+([\w-]+)\("
        producers = set(re.findall(ffn_weight, ex._compiled[shape].as_text()))
        if layer_weights == "per_layer":
            assert producers == {"parameter"}, producers
        else:
            assert "fusion" in producers, producers
