"""Tests for the Pallas kernel's compiled form (pallas_kernels.ragged_paged_attention.pallas);
its numerics are checked, in interpret mode everywhere and compiled on GPU, by
test_ragged_paged_attention.py."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import pytest

from pallas_kernels.ragged_paged_attention import BlockSizes, default_block_sizes
from pallas_kernels.ragged_paged_attention import pallas as pallas_mod

# --------------------------------------------------------------------------------------------
# The GPU kernel lowers to Triton (checked on CPU too: JAX lowers for CUDA without a GPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "num_tokens", "bs"),
    [
        (jnp.bfloat16, 64, None),  # prefill tiling
        (jnp.bfloat16, 8, None),  # decode tiling (KV splits)
        (jnp.float32, 64, BlockSizes(4, 32, 2, 4, 2)),
    ],
)
def test_kernel_lowers_for_cuda(dtype: Any, num_tokens: int, bs: BlockSizes | None) -> None:
    t, hq, hkv, d, p, ps, s, pps = num_tokens, 32, 8, 128, 40, 16, 8, 4
    bs = bs or default_block_sizes(t, s, hq, hkv, d)
    args = (
        jnp.zeros((t, hq, d), dtype),
        jnp.zeros((p, ps, hkv, d), dtype),
        jnp.zeros((p, ps, hkv, d), dtype),
        jnp.zeros((s,), jnp.int32),
        jnp.zeros((s, pps), jnp.int32),
        jnp.zeros((s + 1,), jnp.int32),
        jnp.int32(1),
    )
    traced = pallas_mod.rpa_pallas.trace(*args, sm_scale=0.1, bs=bs, interpret=False)
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
