"""Ragged paged attention over the combined K/V pool (JAX's TPU kernel's layout): the layout
helpers, the op against the dense oracle of the split op, JAX's Mosaic kernel lowered for a
TPU from this CPU host, and the refusals."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from pretend_tpu import pretend_tpu
from rpa_cases import make_case, oracle

from pallas_kernels import _common
from pallas_kernels.ragged_paged_attention import (
    combine_kv,
    ragged_paged_attention,
    ragged_paged_attention_combined,
    split_kv,
)
from pallas_kernels.ragged_paged_attention.combined import tpu_kernel_obstacle

ARGS = ("kv_lens", "page_indices", "cu_q_lens", "num_seqs")


def _case(head_dim: int = 16, dtype: Any = jnp.float32) -> dict[str, Any]:  # noqa: ANN401
    rng = np.random.default_rng(3)
    return make_case(rng, q_lens=[5, 1, 9, 1], histories=[0, 17, 6, 30], max_seqs=6,
                     num_tokens=24, head_dim=head_dim, page_size=4, num_kv_heads=2, ratio=3,
                     pages_per_seq=9, dtype=dtype)


def test_combine_interleaves_k_and_v_per_head_and_split_undoes_it() -> None:
    k = np.arange(2 * 3 * 4).reshape(2, 3, 4)
    v = -k
    kv = np.asarray(combine_kv(jnp.asarray(k), jnp.asarray(v)))
    assert kv.shape == (2, 6, 4)
    np.testing.assert_array_equal(kv[:, 0::2], k)  # JAX's kernel reads K at even slots
    np.testing.assert_array_equal(kv[:, 1::2], v)
    np.testing.assert_array_equal(kv[:, 2], k[:, 1])  # head 1: K, then V beside it
    np.testing.assert_array_equal(kv[:, 3], v[:, 1])
    back = split_kv(kv)
    np.testing.assert_array_equal(back[0], k)
    np.testing.assert_array_equal(back[1], v)


@pytest.mark.parametrize("impl", ["xla", "interpret"])
def test_combined_pool_matches_the_dense_oracle(impl: str) -> None:
    case = _case()
    kv = combine_kv(case["k_pages"], case["v_pages"])
    got = ragged_paged_attention_combined(case["q"], kv, *(case[a] for a in ARGS), impl=impl)
    np.testing.assert_allclose(np.asarray(got), oracle(case), atol=1e-5, rtol=1e-5)


def test_obstacles_to_jax_tpu_kernel() -> None:
    assert tpu_kernel_obstacle(8, 2, 128, jnp.bfloat16) is None
    assert tpu_kernel_obstacle(32, 8, 128, jnp.bfloat16) is None  # Llama-3-8B's heads
    assert tpu_kernel_obstacle(4, 2, 128, jnp.float32) is None
    assert "multiple of 128" in tpu_kernel_obstacle(9, 3, 64, jnp.float32)  # SmolLM2's
    assert "cannot tile 6" in tpu_kernel_obstacle(9, 3, 128, jnp.float32)
    assert "cannot tile 6" in tpu_kernel_obstacle(9, 3, 128, jnp.bfloat16)  # 3 rows of 2
    assert "not a multiple" in tpu_kernel_obstacle(5, 2, 128, jnp.float32)


def test_jax_tpu_kernel_lowers_for_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    pretend_tpu(monkeypatch)
    case = _case(head_dim=128, dtype=jnp.bfloat16)
    kv = combine_kv(case["k_pages"], case["v_pages"])
    args = [case["q"], kv, *(jnp.asarray(case[a]) for a in ARGS)]
    fn = jax.jit(lambda *a: ragged_paged_attention_combined(*a))  # auto: "tpu" on a TPU
    text = fn.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "tpu_custom_call" in text and "ragged_paged_attention_kernel" in text


def test_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    case = _case()
    split = [case[a] for a in ("q", "k_pages", "v_pages", *ARGS)]
    with pytest.raises(ValueError, match="combined K/V pool"):
        ragged_paged_attention(*split, impl="tpu")
    kv = combine_kv(case["k_pages"], case["v_pages"])
    combined = [case["q"], kv, *(case[a] for a in ARGS)]
    with pytest.raises(ValueError, match="default backend is 'cpu'"):
        ragged_paged_attention_combined(*combined, impl="tpu")
    with pytest.raises(ValueError, match="head axis must be even"):
        ragged_paged_attention_combined(case["q"], kv[:, :, :3], *(case[a] for a in ARGS))
    monkeypatch.setattr(_common, "on_tpu", lambda: True)
    with pytest.raises(ValueError, match="multiple of 128.*use impl='xla'"):
        ragged_paged_attention_combined(*combined, impl="tpu")  # head dim 16
