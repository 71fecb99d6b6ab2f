"""The Pallas kernel: compiled through Pallas' Triton lowering on GPU (``impl="pallas"``), or
run with ``interpret=True`` on any backend (``impl="interpret"``).

A flash-attention kernel. Program ``(b, h, k)`` takes query block ``b`` of the schedule
(``block_q`` tokens of one sequence times the ``Hq // Hkv`` query heads sharing KV head ``h``,
so every KV tile it loads feeds the whole GQA group; a group that is not a power of two is
padded with zero query heads before the launch), walks that sequence's pages in tiles of
``block_kv`` tokens with an online softmax, and handles the ``k``-th of ``kv_splits`` slices of
its KV range (flash-decoding; the slices are merged afterwards by a small ``jnp`` epilogue).
Tiles entirely below the block's first query position skip masking.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import cdiv, next_pow2, triton_module
from pallas_kernels.ragged_paged_attention.schedule import (
    build_schedule,
    prepare_metadata,
    short_queries,
    token_mask,
)

__all__ = ["BLOCK_SIZE_KEYS", "BlockSizes", "default_block_sizes", "rpa_pallas"]

_LOG2E = math.log2(math.e)
# Finite, as in JAX's own Pallas ops: a fully masked row then yields finite garbage (which is
# never stored) instead of NaN from (-inf) - (-inf).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_M_INIT = float(np.finfo(np.float32).min)
BLOCK_SIZE_KEYS = ("block_q", "block_kv", "kv_splits", "num_warps", "num_stages")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiling of the Pallas kernel (hashable: it is a static argument of the jitted wrapper).

    Attributes:
      block_q: query tokens per program; a program holds ``block_q * next_pow2(Hq // Hkv)``
        query rows (a power of two, as Triton requires).
      block_kv: KV tokens per inner-loop tile (any power of two; need not match page_size).
      kv_splits: programs sharing one query block's KV range (flash-decoding); 1 disables.
      num_warps, num_stages: Triton launch parameters (ignored by ``interpret``).
    """

    block_q: int
    block_kv: int
    kv_splits: int
    num_warps: int
    num_stages: int


def default_block_sizes(
    num_tokens: int, max_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
    query_len: str | None = None,
) -> BlockSizes:
    """Default tiling for a step of ``num_tokens`` tokens over up to ``max_seqs`` sequences.

    A step with at most two tokens per sequence is treated as decode: minimal query blocks
    (16 rows, the smallest Triton ``dot``), long KV tiles and KV splits so that enough
    programs stream KV concurrently. Otherwise prefill tiles of 256 query rows for
    ``head_dim == 128``, 128 below, 64 above. ``query_len`` overrides the guess from the shapes
    (``schedule.short_queries``).
    """
    group_pad = next_pow2(num_q_heads // num_kv_heads)
    block_kv = 64 if head_dim <= 128 else 32
    if short_queries(num_tokens, max_seqs, query_len):
        live_programs = max(1, max_seqs * num_kv_heads)
        # About a thousand concurrent programs, 128-token KV tiles and 8 warps: on an H200
        # (64 sequences x 8K context, 8 KV heads of 128) the best of the sweep, 2522 GB/s,
        # against 2013 for 256 programs, 64-token tiles and 4 warps (bench/RESULTS.md).
        kv_splits = min(8, next_pow2(cdiv(1024, live_programs)))
        if head_dim <= 128:
            return BlockSizes(max(1, 16 // group_pad), 128, kv_splits, 8, 3)
        return BlockSizes(max(1, 16 // group_pad), block_kv, kv_splits, 4, 3)
    # 256 query rows a program for d=128: on an H200 (8K chunk over 8K, GQA 4) the best of
    # the sweep in two runs, 357 and 376 TFLOP/s against 242 and 239 for 128 rows
    # (bench/RESULTS.md). Other head sizes keep 128 (64 past 128): not measured.
    rows = 256 if head_dim == 128 else 128 if head_dim < 128 else 64
    num_warps = 8 if head_dim >= 128 else 4
    num_stages = 3 if head_dim <= 64 else 2
    return BlockSizes(max(1, rows // group_pad), block_kv, 1, num_warps, num_stages)


def _rpa_kernel(
    seq_ref: Any,  # i32[G]  sequence of each query block, -1 = idle
    tok0_ref: Any,  # i32[G]  first token of the block
    ntok_ref: Any,  # i32[G]  valid tokens in the block
    pos0_ref: Any,  # i32[G]  absolute position of the block's first token
    page_table_ref: Any,  # i32[S, pages_per_seq]  already clipped to [0, P)
    q_ref: Any,  # f[T*Hq, d]  Hq = Hkv * group, group a power of two
    k_ref: Any,  # f[P*page_size, Hkv, d]
    v_ref: Any,  # f[P*page_size, Hkv, d]
    *out_refs: Any,  # kv_splits == 1: o f[T*Hq, d]
    # else: o f32[splits, T*Hq, d] (normalised per split), m f32[splits, T*Hq], l (same)
    sm_scale: float,
    group: int,
    page_size: int,
    block_q: int,
    block_kv: int,
    kv_splits: int,
) -> None:
    plgpu = triton_module()
    blk, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = seq_ref[blk]

    @pl.when(seq >= 0)
    def _() -> None:
        num_rows, head_dim = q_ref.shape
        pages_per_seq = page_table_ref.shape[1]
        num_q_heads = k_ref.shape[1] * group
        rows_per_block = block_q * group
        tok0, ntok, pos0 = tok0_ref[blk], ntok_ref[blk], pos0_ref[blk]

        # Row r of the block is query token r // group, head h*group + r % group.
        r = lax.iota(jnp.int32, rows_per_block)
        t_local, g = lax.div(r, group), lax.rem(r, group)
        row_ok = t_local < ntok
        rows = (tok0 + t_local) * num_q_heads + head * group + g
        cols = lax.iota(jnp.int32, head_dim)
        row_mask = jnp.broadcast_to(row_ok[:, None], (rows_per_block, head_dim))
        q_rows = jnp.where(row_ok, rows, 0)
        q = plgpu.load(q_ref.at[q_rows[:, None], cols[None, :]], mask=row_mask, other=0)
        q_pos = pos0 + t_local
        last_pos = pos0 + ntok - 1

        # KV tiles [0, n_blocks) are visible to some row; [0, n_full) to every row (no mask).
        n_blocks = lax.div(jnp.maximum(last_pos + block_kv, 0), block_kv)
        n_full = lax.div(jnp.maximum(pos0 + 1, 0), block_kv)
        chunk = lax.div(n_blocks + kv_splits - 1, kv_splits)
        lo = split * chunk
        hi = jnp.minimum(n_blocks, lo + chunk)
        mid = jnp.minimum(jnp.maximum(n_full, lo), hi)
        scale = sm_scale * _LOG2E  # exp2 below
        # Exact fp32 dots for fp32 KV (no TF32); bf16 dots accumulate in fp32 by default.
        precision = lax.Precision.HIGHEST if k_ref.dtype == jnp.float32 \
            else lax.Precision.DEFAULT

        def tile(j: jax.Array, carry: tuple[jax.Array, ...], masked: bool) -> tuple[jax.Array, ...]:
            acc, m_prev, l_prev = carry
            kv_pos = j * block_kv + lax.iota(jnp.int32, block_kv)
            slot = jnp.minimum(lax.div(kv_pos, page_size), pages_per_seq - 1)
            page = page_table_ref[seq, slot]
            kv_rows = page * page_size + lax.rem(kv_pos, page_size)
            idx = (kv_rows[:, None], head, cols[None, :])
            if masked:
                # Past the block's last query nothing is needed (or even written yet).
                kv_ok = jnp.broadcast_to((kv_pos <= last_pos)[:, None], (block_kv, head_dim))
                k = plgpu.load(k_ref.at[idx], mask=kv_ok, other=0)
                v = plgpu.load(v_ref.at[idx], mask=kv_ok, other=0)
            else:
                k = plgpu.load(k_ref.at[idx])
                v = plgpu.load(v_ref.at[idx])
            s = plgpu.dot(q, k, trans_b=True, precision=precision) * scale
            if masked:
                s = jnp.where(kv_pos[None, :] <= q_pos[:, None], s, _MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            alpha = jnp.exp2(m_prev - m_next)
            prob = jnp.exp2(s - m_next[:, None])
            l_next = alpha * l_prev + jnp.sum(prob, axis=1)
            pv = plgpu.dot(prob.astype(v.dtype), v, precision=precision)
            return alpha[:, None] * acc + pv, m_next, l_next

        carry = (
            jnp.zeros((rows_per_block, head_dim), jnp.float32),
            jnp.full((rows_per_block,), _M_INIT, jnp.float32),
            jnp.zeros((rows_per_block,), jnp.float32),
        )
        carry = lax.fori_loop(lo, mid, functools.partial(tile, masked=False), carry)
        acc, m, l_sum = lax.fori_loop(mid, hi, functools.partial(tile, masked=True), carry)

        out = acc / jnp.where(l_sum == 0, 1.0, l_sum)[:, None]
        # Masked-off rows point past the end: never stored (interpret drops them too).
        out_rows = jnp.where(row_ok, rows, num_rows)
        if kv_splits == 1:
            (o_ref,) = out_refs
            plgpu.store(
                o_ref.at[out_rows[:, None], cols[None, :]], out.astype(o_ref.dtype), mask=row_mask
            )
        else:
            o_ref, m_ref, l_ref = out_refs
            plgpu.store(o_ref.at[split, out_rows[:, None], cols[None, :]], out, mask=row_mask)
            plgpu.store(m_ref.at[split, out_rows], m, mask=row_ok)
            plgpu.store(l_ref.at[split, out_rows], l_sum, mask=row_ok)


@functools.partial(jax.jit, static_argnames=("sm_scale", "bs", "interpret"))
def rpa_pallas(
    q: jax.Array,  # f[T, Hq, d]
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    bs: BlockSizes,
    interpret: bool,
) -> jax.Array:  # f[T, Hq, d]
    """Jitted kernel launch plus the split-KV merge: inputs already validated, ``sm_scale``
    resolved, ``bs`` checked for ``interpret`` (or, with ``interpret=False``, for Triton)."""
    plgpu = triton_module()
    t, hq_in, d = q.shape
    p, ps, hkv, _ = k_pages.shape
    s, _ = page_indices.shape
    group_in = hq_in // hkv
    group = next_pow2(group_in)
    if group != group_in:
        # Zero query heads fill each group to a power of two, so the kernel never masks a
        # row of a live token (on an H200, float32 calls with GQA groups of 3 and masked
        # rows never completed). The kernel computed those rows anyway: only q grows.
        q = jnp.pad(q.reshape(t, hkv, group_in, d), ((0, 0), (0, 0), (0, group - group_in),
                                                     (0, 0))).reshape(t, hkv * group, d)
    hq = hkv * group
    kv_lens, page_indices, cu, n = prepare_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, s)
    sch = build_schedule(cu, kv_lens, num_tokens=t, block_q=bs.block_q)
    num_blocks = sch.seq.shape[0]
    # Garbage entries (unused slots, dead sequences) must never address outside the pool.
    page_table = jnp.clip(page_indices, 0, p - 1)
    rows = t * hq

    kernel = functools.partial(
        _rpa_kernel,
        sm_scale=sm_scale,
        group=group,
        page_size=ps,
        block_q=bs.block_q,
        block_kv=bs.block_kv,
        kv_splits=bs.kv_splits,
    )
    if bs.kv_splits == 1:
        out_shape: Any = jax.ShapeDtypeStruct((rows, d), q.dtype)
    else:
        out_shape = (
            jax.ShapeDtypeStruct((bs.kv_splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((bs.kv_splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((bs.kv_splits, rows), jnp.float32),
        )
    outs = pl.pallas_call(
        kernel,
        grid=(num_blocks, hkv, bs.kv_splits),
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=bs.num_stages),
        name="ragged_paged_attention",
    )(
        sch.seq,
        sch.tok0,
        sch.ntok,
        sch.pos0,
        page_table,
        q.reshape(rows, d),
        k_pages.reshape(p * ps, hkv, d),
        v_pages.reshape(p * ps, hkv, d),
    )
    if bs.kv_splits == 1:
        out = outs
    else:
        # Merge the splits' partial softmaxes (m is in log2 units, like the kernel's exp2).
        o_parts, m_parts, l_parts = outs
        weight = l_parts * jnp.exp2(m_parts - jnp.max(m_parts, axis=0))
        denom = jnp.sum(weight, axis=0)
        out = jnp.sum(weight[..., None] * o_parts, axis=0)
        out = out / jnp.where(denom == 0, 1.0, denom)[:, None]
    # Rows of padding tokens were never written (garbage / NaN): select, don't multiply.
    out = jnp.where(token_mask(cu, n, t)[:, None, None], out.reshape(t, hq, d), 0)
    if group != group_in:
        out = out.reshape(t, hkv, group, d)[:, :, :group_in].reshape(t, hq_in, d)
    return out.astype(q.dtype)
