"""Shared by the ragged paged attention tests: random cases, running an impl, and checking its
output against the package's dense float64 reference ``ref_ragged_paged_attention``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _common
from pallas_kernels.ragged_paged_attention import (
    ragged_paged_attention,
    ref_ragged_paged_attention,
)

# Compiled Pallas only where a GPU is present; interpret runs the same kernel body anywhere.
IMPLS = _common.impls_under_test()
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}
ARG_NAMES = ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")


def oracle(case: dict[str, Any]) -> np.ndarray:
    """f64[T, Hq, d] reference output for ``case`` (rows of non-live tokens are zero)."""
    return ref_ragged_paged_attention(*(case[k] for k in ARG_NAMES), sm_scale=case.get("sm_scale"))


def make_case(
    rng: np.random.Generator,
    *,
    q_lens: list[int],
    histories: list[int],
    max_seqs: int,
    num_tokens: int,
    head_dim: int,
    page_size: int,
    num_kv_heads: int,
    ratio: int,
    pages_per_seq: int,
    dtype: Any = jnp.float32,
    extra_pages: int = 3,
) -> dict[str, Any]:
    """A batch whose first len(q_lens) sequences are live; everything else is garbage."""
    n = len(q_lens)
    assert n <= max_seqs and sum(q_lens) <= num_tokens
    num_pages = max_seqs * pages_per_seq + extra_pages
    hq = num_kv_heads * ratio
    cu = np.zeros(max_seqs + 1, np.int32)
    cu[1 : n + 1] = np.cumsum(q_lens)
    cu[n + 1 :] = rng.integers(-5, 3 * num_tokens, max_seqs - n)  # garbage, even decreasing
    kv_lens = rng.integers(-3, 10_000, max_seqs).astype(np.int32)  # garbage past num_seqs
    kv_lens[:n] = np.asarray(q_lens) + np.asarray(histories)
    # Unused page-table slots hold garbage, including indices outside the pool.
    pt = rng.integers(-num_pages, 2 * num_pages, (max_seqs, pages_per_seq)).astype(np.int32)
    perm = rng.permutation(num_pages)
    for s in range(n):
        used = -(-int(kv_lens[s]) // page_size)
        assert used <= pages_per_seq
        pt[s, :used] = perm[s * pages_per_seq : s * pages_per_seq + used]

    def rand(*shape: int) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    return dict(
        q=rand(num_tokens, hq, head_dim),
        k_pages=rand(num_pages, page_size, num_kv_heads, head_dim),
        v_pages=rand(num_pages, page_size, num_kv_heads, head_dim),
        kv_lens=kv_lens,
        page_indices=pt,
        cu_q_lens=cu,
        num_seqs=np.int32(n),
    )


def run(case: dict[str, Any], impl: str, **kw: Any) -> np.ndarray:
    out = ragged_paged_attention(
        case["q"],
        case["k_pages"],
        case["v_pages"],
        case["kv_lens"],
        case["page_indices"],
        case["cu_q_lens"],
        case["num_seqs"],
        sm_scale=case.get("sm_scale"),
        impl=impl,
        **kw,
    )
    assert out.shape == case["q"].shape and out.dtype == case["q"].dtype
    return np.asarray(out.astype(jnp.float32))


def check(case: dict[str, Any], out: np.ndarray, dtype: Any = jnp.float32) -> None:
    want = oracle(case)
    assert np.isfinite(out).all(), "non-finite output"
    live_end = int(case["cu_q_lens"][int(case["num_seqs"])])
    assert (out[live_end:] == 0).all(), "padding rows must be exactly zero"
    err = np.abs(out - want).max() / max(np.abs(want).max(), 1e-30)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


def pallas_safe(kw: dict[str, int], case: dict[str, Any]) -> dict[str, int]:
    """Compiled Triton dots need >= 16 rows and columns: grow drawn blocks if needed."""
    group_pad = _common.next_pow2(case["q"].shape[1] // case["k_pages"].shape[2])
    kw = dict(kw)
    if "block_q" in kw:
        kw["block_q"] = max(kw["block_q"], 16 // group_pad, 1)
    if "block_kv" in kw:
        kw["block_kv"] = max(kw["block_kv"], 16)
    return kw


def valid_case() -> dict[str, Any]:
    """A small valid batch: two live sequences out of three slots."""
    return make_case(
        np.random.default_rng(6),
        q_lens=[2, 3],
        histories=[4, 0],
        max_seqs=3,
        num_tokens=8,
        head_dim=64,
        page_size=16,
        num_kv_heads=2,
        ratio=2,
        pages_per_seq=2,
    )


def with_changes(**changes: Any) -> dict[str, Any]:
    """``valid_case()`` with ``case[key] = fn(case[key])`` for each ``key=fn``."""
    case = valid_case()
    for key, fn in changes.items():
        case[key] = fn(case[key])
    return case
