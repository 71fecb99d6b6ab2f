"""Ragged paged attention over one combined K/V pool: the layout of JAX's own TPU kernel.

``kv_pages f[P, page_size, 2*Hkv, d]`` holds K of KV head ``h`` at slot ``2h`` and V at slot
``2h + 1`` (``combine_kv``): one DMA brings a page's K and V of a head together, which is
why ``jax.experimental.pallas.ops.tpu.ragged_paged_attention`` reads this layout. A
contiguous shard of the combined head axis is whole K/V pairs, so the step's
sequence-parallel all-to-alls and its TP sharding split this pool as they split a K or a
V pool.

``ragged_paged_attention_combined`` has ``ragged_paged_attention``'s contract (see ``api``)
with the one pool in place of two. ``impl="tpu"`` (auto on a TPU backend) runs JAX's Mosaic
kernel (the kernel is JAX's; this file holds its wrapper); ``"xla"`` runs the split op's
XLA path on the pool's pages as gathered (K and V taken apart per chunk, never the whole
pool); the Pallas kernel (``"interpret"``, ``"pallas"``) reads K and V as strided views.
The split op's dense oracle (``ref_ragged_paged_attention`` on ``split_kv``) is this op's
reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._common import TPU_IMPL, check_float_array, resolve_impl
from pallas_kernels.ragged_paged_attention.api import ragged_paged_attention, run_xla
from pallas_kernels.ragged_paged_attention.validation import softmax_scale, validate

__all__ = ["combine_kv", "ragged_paged_attention_combined", "split_kv", "tpu_kernel_obstacle"]


def combine_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """k, v f[..., H, d] -> f[..., 2H, d] with K of head h at 2h and V at 2h + 1."""
    *lead, h, d = k.shape
    return jnp.stack([k, v], axis=-2).reshape(*lead, 2 * h, d)


def split_kv(kv: Any) -> tuple[Any, Any]:  # noqa: ANN401 (jax or numpy arrays)
    """f[..., 2H, d] -> (K f[..., H, d], V f[..., H, d]): the views ``combine_kv`` undoes."""
    return kv[..., 0::2, :], kv[..., 1::2, :]


def tpu_kernel_obstacle(num_q_heads: int, num_kv_heads: int, head_dim: int,
                        dtype: Any) -> str | None:  # noqa: ANN401
    """Why JAX's TPU kernel cannot take these per-call head counts (None when it can): its
    flash loop broadcasts 128-lane rows over the head dim, and Mosaic tiles the combined head
    axis only in whole (8, 128) tiles or 1, 2, 4 or 8 packed rows."""
    if head_dim % 128:
        return f"JAX's TPU kernel needs a head dim that is a multiple of 128, got {head_dim}"
    if num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads are not a multiple of {num_kv_heads} KV heads"
    packing = max(1, 4 // np.dtype(dtype).itemsize)  # rows per 32-bit sublane
    combined = 2 * num_kv_heads
    rows, rem = divmod(combined, packing)
    if rem or not (rows in (1, 2, 4, 8) or rows % 8 == 0):
        return (f"JAX's TPU kernel cannot tile {combined} combined K/V heads of "
                f"{np.dtype(dtype).name} (it needs 1, 2, 4, 8 or a multiple of 8 rows of "
                f"{packing})")
    return None


def ragged_paged_attention_combined(
    q: jax.Array,  # f[T, Hq, d]
    kv_pages: jax.Array,  # f[P, page_size, 2*Hkv, d]: K at even head slots, V at odd
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[] or i32[1]
    *,
    sm_scale: float | None = None,
    impl: str | None = None,
    query_len: str | None = None,
) -> jax.Array:  # f[T, Hq, d]
    """``ragged_paged_attention`` over the combined pool (see the module docstring); rows of
    tokens outside live sequences come back 0, as there."""
    p, ps, h2, d = check_float_array("kv_pages", kv_pages, 4)
    if h2 % 2:
        raise ValueError(f"kv_pages holds K/V pairs: its head axis must be even, got {h2}")
    impl = resolve_impl(impl, combined_kv=True)
    half = jax.ShapeDtypeStruct((p, ps, h2 // 2, d), kv_pages.dtype)  # shapes only
    dims = validate(q, half, half, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale)
    if impl == "xla":  # gathers each chunk's pages of the pool, then takes K and V apart
        return run_xla(dims, q, kv_pages, None, kv_lens, page_indices, cu_q_lens, num_seqs,
                       sm_scale=sm_scale, query_len=query_len)
    if impl != TPU_IMPL:  # the Pallas kernel on strided views (tests)
        k, v = split_kv(kv_pages)
        return ragged_paged_attention(q, k, v, kv_lens, page_indices, cu_q_lens, num_seqs,
                                      sm_scale=sm_scale, impl=impl, query_len=query_len)
    why = tpu_kernel_obstacle(dims.num_q_heads, dims.num_kv_heads, d, kv_pages.dtype)
    if why:
        raise ValueError(f"impl='tpu': {why}; use impl='xla'")
    # Imported here: the module pulls in Mosaic's lowering, which only a TPU run needs.
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import (
        ragged_paged_attention as tpu_ragged_paged_attention,
    )

    count = jnp.reshape(num_seqs, (1,)).astype(jnp.int32)
    out = tpu_ragged_paged_attention(
        q, kv_pages, kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
        cu_q_lens.astype(jnp.int32), count, sm_scale=softmax_scale(dims, sm_scale))
    # The kernel leaves rows past the live tokens as it finds them; the contract says 0.
    live = jnp.arange(q.shape[0]) < cu_q_lens[count[0]]
    return jnp.where(live[:, None, None], out, jnp.zeros((), out.dtype))
