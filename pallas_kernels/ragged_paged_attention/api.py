"""Ragged paged attention: prefill chunks, decode and mixed batches in one op.

Queries of many sequences are packed along one token axis ``q: [T, Hq, d]``. Sequence ``s``
owns rows ``q[cu_q_lens[s]:cu_q_lens[s+1]]`` (possibly none), has ``kv_lens[s]`` KV entries
once this step's tokens are written (history plus this chunk), and finds them through its row
of the page table ``page_indices[s]`` in the KV pools ``k_pages`` / ``v_pages``
``[P, page_size, Hkv, d]`` (separate K and V pools, not fused). Query ``j`` of sequence ``s``
sits at absolute position ``kv_lens[s] - q_len_s + j`` and attends causally to KV positions
``0 ..`` that position. GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. Only the first
``num_seqs`` (traced) sequences are live; rows of all other tokens come back exactly zero.

``ragged_paged_attention`` validates its arguments and dispatches to one implementation (see
``pallas_kernels._common``): ``"xla"`` (``xla.py``, tiled pure ``jnp``), ``"pallas"`` or
``"interpret"`` (``pallas.py``, the Pallas kernel). ``reference.py`` holds the dense oracle
all three are tested against.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from pallas_kernels._common import is_pow2, next_pow2, resolve_impl
from pallas_kernels.ragged_paged_attention import pallas, xla
from pallas_kernels.ragged_paged_attention.pallas import (
    BLOCK_SIZE_KEYS,
    BlockSizes,
    default_block_sizes,
)
from pallas_kernels.ragged_paged_attention.validation import Dims, softmax_scale, validate

__all__ = ["ragged_paged_attention"]


def _block_sizes(dims: Dims, impl: str, overrides: dict[str, Any],
                 query_len: str | None = None) -> BlockSizes:
    """``default_block_sizes`` with the caller's overrides, checked for ``impl``."""
    unknown = set(overrides) - set(BLOCK_SIZE_KEYS)
    if unknown:
        raise ValueError(
            f"unknown block size option(s) {sorted(unknown)}; expected some of {BLOCK_SIZE_KEYS}"
        )
    bs = dataclasses.replace(
        default_block_sizes(
            dims.num_tokens, dims.max_seqs, dims.num_q_heads, dims.num_kv_heads, dims.head_dim,
            query_len,
        ),
        **overrides,
    )
    for key in BLOCK_SIZE_KEYS:
        val = getattr(bs, key)
        if not isinstance(val, int | np.integer) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{key} must be a positive int, got {val!r}")
    if not (is_pow2(bs.block_q) and is_pow2(bs.block_kv)):
        raise ValueError(
            f"block_q={bs.block_q} and block_kv={bs.block_kv} must be powers of two (Triton blocks)"
        )
    if impl == "xla":
        return bs
    group_pad = next_pow2(dims.num_q_heads // dims.num_kv_heads)
    if not (is_pow2(dims.head_dim) and dims.head_dim >= 16):
        raise ValueError(
            f"the Pallas kernel needs a power-of-two head dim >= 16, got d={dims.head_dim}; use "
            "impl='xla'"
        )
    if impl == "pallas" and (bs.block_q * group_pad < 16 or bs.block_kv < 16):
        raise ValueError(
            f"Triton dots need >= 16 rows and columns: block_q*next_pow2(Hq//Hkv)="
            f"{bs.block_q * group_pad}, block_kv={bs.block_kv}"
        )
    return bs


def run_xla(dims: Dims, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array | None,
            *meta: jax.Array, sm_scale: float | None, query_len: str | None) -> jax.Array:
    """The XLA path on validated arguments (``meta``: kv_lens, page_indices, cu_q_lens,
    num_seqs) at its default tiling; ``v_pages`` None: ``k_pages`` is a combined pool."""
    tiling = xla.default_xla_tiling(dims.num_tokens, dims.max_seqs, query_len)
    return xla.rpa_xla(q, k_pages, v_pages, *meta, sm_scale=softmax_scale(dims, sm_scale),
                       **tiling._asdict())


def ragged_paged_attention(
    q: jax.Array,  # f[T, Hq, d]
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[] or i32[1]
    *,
    sm_scale: float | None = None,
    impl: str | None = None,
    query_len: str | None = None,
    **block_sizes: int,
) -> jax.Array:  # f[T, Hq, d]
    """Causal GQA attention of packed ragged queries over paged KV (see the module docstring).

    Args:
      q: f[T, Hq, d] queries of all sequences, packed along T.
      k_pages, v_pages: f[P, page_size, Hkv, d] this layer's K and V pools (same dtype as q).
      kv_lens: i32[S] KV length of each sequence after this step's tokens are written.
      page_indices: i32[S, pages_per_seq] page table.
      cu_q_lens: i32[S+1] query spans; sequence s owns q[cu_q_lens[s]:cu_q_lens[s+1]].
      num_seqs: i32[] or i32[1], may be traced: only the first num_seqs sequences are live.
      sm_scale: logit scale, default 1/sqrt(d).
      impl: None (auto; ``$CONFLUX_ATTENTION_IMPL`` overrides), "xla", "pallas" or
        "interpret".
      query_len: how to tile, "short" (decode-like: a token or two per sequence) or "long"
        (prefill-like); None guesses from the shapes (short when T <= 2 * S).
      **block_sizes: Pallas tiling overrides, any of block_q, block_kv, kv_splits, num_warps,
        num_stages (see ``BlockSizes``; defaults from ``default_block_sizes``). The XLA path
        accepts (and checks) but ignores them.

    Returns:
      f[T, Hq, d]; rows of tokens outside live sequences (>= cu_q_lens[num_seqs]) are 0.

    Raises:
      ValueError: inconsistent shapes or dtypes, or (when the metadata is concrete rather than
        traced) inconsistent values, before anything is traced.
    """
    dims = validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale)
    impl = resolve_impl(impl)
    bs = _block_sizes(dims, impl, block_sizes, query_len)
    if impl == "xla":
        return run_xla(dims, q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                       sm_scale=sm_scale, query_len=query_len)
    return pallas.rpa_pallas(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=softmax_scale(dims, sm_scale),
        bs=bs,
        interpret=impl == "interpret",
    )
