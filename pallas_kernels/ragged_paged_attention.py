"""Ragged paged attention: prefill chunks, decode and mixed batches in one op.

Queries of many sequences are packed along one token axis ``q: [T, Hq, d]``. Sequence ``s``
owns rows ``q[cu_q_lens[s]:cu_q_lens[s+1]]`` (possibly none), has ``kv_lens[s]`` KV entries
once this step's tokens are written (history plus this chunk), and finds them through its row
of the page table ``page_indices[s]`` in the KV pools ``k_pages`` / ``v_pages``
``[P, page_size, Hkv, d]`` (separate K and V pools, not fused). Query ``j`` of sequence ``s``
sits at absolute position ``kv_lens[s] - q_len_s + j`` and attends causally to KV positions
``0 ..`` that position. GQA: query head ``h`` reads KV head ``h // (Hq // Hkv)``. Only the first
``num_seqs`` (traced) sequences are live; rows of all other tokens come back exactly zero.

Three implementations (see ``pallas_kernels._common``):

* ``ragged_paged_attention_reference``: pure ``jnp`` (the fast path on CPU). Prefill: the
  kernel's 32-token query blocks a group at a time, vectorized over the group, over their
  pages in chunks of 128 tokens up to the group's furthest position, with an online
  softmax; groups of idle blocks are skipped. Decode: every (sequence, 128-token chunk)
  pair is a work item, items run a group at a time and partial softmaxes are merged per
  sequence (flash-decoding). Either way the cost follows the live lengths, not the page
  table's width.
* The Pallas kernel (``impl="pallas"`` compiled through Pallas' Triton lowering on GPU,
  ``impl="interpret"`` anywhere): a flash-attention kernel. Program ``(b, h, k)`` takes query
  block ``b`` (``block_q`` tokens of one sequence times the ``Hq // Hkv`` query heads sharing
  KV head ``h``, so every KV tile it loads feeds the whole GQA group), walks that sequence's
  pages in tiles of ``block_kv`` tokens with an online softmax, and handles the ``k``-th of
  ``kv_splits`` slices of its KV range (flash-decoding; the slices are merged afterwards by a
  small ``jnp`` epilogue). Tiles entirely below the block's first query position skip masking.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    cdiv,
    check_float_array,
    check_int_array,
    concrete_or_none,
    is_pow2,
    next_pow2,
    resolve_impl,
    triton_module,
)

__all__ = [
    "BlockSizes",
    "default_block_sizes",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
]

_LOG2E = math.log2(math.e)
# Finite, as in JAX's own Pallas ops: a fully masked row then yields finite garbage (which is
# never stored) instead of NaN from (-inf) - (-inf).
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_M_INIT = float(np.finfo(np.float32).min)
_BLOCK_SIZE_KEYS = ("block_q", "block_kv", "kv_splits", "num_warps", "num_stages")


# --------------------------------------------------------------------------------------------
# Shapes, block sizes, validation
# --------------------------------------------------------------------------------------------


class _Dims(NamedTuple):
    num_tokens: int  # T
    num_q_heads: int  # Hq
    head_dim: int  # d
    num_pages: int  # P
    page_size: int
    num_kv_heads: int  # Hkv
    max_seqs: int  # S
    pages_per_seq: int


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
    num_tokens: int, max_seqs: int, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> BlockSizes:
    """Default tiling for a step of ``num_tokens`` tokens over up to ``max_seqs`` sequences.

    A step with at most two tokens per sequence is treated as decode: minimal query blocks
    (16 rows, the smallest Triton ``dot``) and KV splits so that enough programs stream KV
    concurrently. Otherwise prefill tiles of 128 query rows (64 for ``head_dim > 128``).
    """
    group_pad = next_pow2(num_q_heads // num_kv_heads)
    block_kv = 64 if head_dim <= 128 else 32
    if num_tokens <= 2 * max_seqs:
        live_programs = max(1, max_seqs * num_kv_heads)
        # Aim for a few hundred concurrent programs (~2 per SM on an H100/H200 class GPU).
        kv_splits = min(8, next_pow2(cdiv(256, live_programs)))
        return BlockSizes(max(1, 16 // group_pad), block_kv, kv_splits, 4, 3)
    rows = 128 if head_dim <= 128 else 64
    num_warps = 8 if head_dim >= 128 else 4
    num_stages = 3 if head_dim <= 64 else 2
    return BlockSizes(max(1, rows // group_pad), block_kv, 1, num_warps, num_stages)


def _validate(
    q: Any,
    k_pages: Any,
    v_pages: Any,
    kv_lens: Any,
    page_indices: Any,
    cu_q_lens: Any,
    num_seqs: Any,
    sm_scale: float | None,
) -> _Dims:
    """Static (shape / dtype) checks, plus value checks when the metadata is concrete."""
    t, hq, d = check_float_array("q", q, 3)
    p, ps, hkv, dk = check_float_array("k_pages", k_pages, 4)
    check_float_array("v_pages", v_pages, 4)
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise ValueError(
            f"k_pages and v_pages must have the same shape [P, page_size, Hkv, d], got "
            f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}"
        )
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(
            f"q, k_pages and v_pages must share one dtype, got {q.dtype}, {k_pages.dtype}, "
            f"{v_pages.dtype}"
        )
    if dk != d:
        raise ValueError(f"head dim mismatch: q has d={d}, k_pages/v_pages have d={dk}")
    if min(t, hq, d, p, ps, hkv) < 1:
        raise ValueError(f"empty dimension: q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads")
    (s,) = check_int_array("kv_lens", kv_lens, (1,))
    s_pt, pps = check_int_array("page_indices", page_indices, (2,))
    (s1,) = check_int_array("cu_q_lens", cu_q_lens, (1,))
    ns_shape = check_int_array("num_seqs", num_seqs, (0, 1))
    if s < 1:
        raise ValueError("kv_lens must describe at least one sequence slot (S >= 1)")
    if s_pt != s:
        raise ValueError(f"page_indices has {s_pt} rows but kv_lens describes S={s} sequences")
    if pps < 1:
        raise ValueError("page_indices must have at least one page per sequence")
    if s1 != s + 1:
        raise ValueError(f"cu_q_lens must have S+1={s + 1} entries (S={s} from kv_lens), got {s1}")
    if ns_shape not in ((), (1,)):
        raise ValueError(f"num_seqs must be a scalar or shape (1,), got {ns_shape}")
    if sm_scale is not None and not (isinstance(sm_scale, int | float) and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be a finite float or None, got {sm_scale!r}")
    dims = _Dims(t, hq, d, p, ps, hkv, s, pps)
    _check_values(dims, kv_lens, page_indices, cu_q_lens, num_seqs)
    return dims


def _check_values(
    dims: _Dims, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any
) -> None:
    """Metadata consistency for live sequences; skipped when any of it is traced."""
    vals = [concrete_or_none(x) for x in (kv_lens, page_indices, cu_q_lens, num_seqs)]
    if any(v is None for v in vals):
        return
    kv, pt, cu, ns = vals
    n = int(ns.reshape(()))
    if not 0 <= n <= dims.max_seqs:
        raise ValueError(f"num_seqs={n} is outside [0, S={dims.max_seqs}]")
    cu = cu[: n + 1].astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens[0] must be 0, got {cu[0]}")
    q_lens = np.diff(cu)
    if (q_lens < 0).any():
        raise ValueError(f"cu_q_lens must be non-decreasing over live sequences, got {cu}")
    if cu[-1] > dims.num_tokens:
        raise ValueError(
            f"cu_q_lens[num_seqs]={cu[-1]} exceeds the token axis of q (T={dims.num_tokens})"
        )
    kv = kv[:n].astype(np.int64)
    if (kv < q_lens).any():
        bad = int(np.argmax(kv < q_lens))
        raise ValueError(
            f"sequence {bad}: kv_lens={kv[bad]} is smaller than its query length {q_lens[bad]} "
            "(kv_lens counts history plus this step's tokens)"
        )
    capacity = dims.pages_per_seq * dims.page_size
    if (kv > capacity).any():
        bad = int(np.argmax(kv > capacity))
        raise ValueError(
            f"sequence {bad}: kv_lens={kv[bad]} exceeds pages_per_seq*page_size={capacity}"
        )
    for i in range(n):
        used = pt[i, : cdiv(int(kv[i]), dims.page_size)]
        if ((used < 0) | (used >= dims.num_pages)).any():
            raise ValueError(
                f"sequence {i}: page_indices {used.tolist()} reference pages outside "
                f"[0, {dims.num_pages})"
            )


def _block_sizes(dims: _Dims, impl: str, overrides: dict[str, Any]) -> BlockSizes:
    unknown = set(overrides) - set(_BLOCK_SIZE_KEYS)
    if unknown:
        raise ValueError(
            f"unknown block size option(s) {sorted(unknown)}; expected some of {_BLOCK_SIZE_KEYS}"
        )
    bs = dataclasses.replace(
        default_block_sizes(
            dims.num_tokens, dims.max_seqs, dims.num_q_heads, dims.num_kv_heads, dims.head_dim
        ),
        **overrides,
    )
    for key in _BLOCK_SIZE_KEYS:
        val = getattr(bs, key)
        if not isinstance(val, int | np.integer) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{key} must be a positive int, got {val!r}")
    if not (is_pow2(bs.block_q) and is_pow2(bs.block_kv)):
        raise ValueError(
            f"block_q={bs.block_q} and block_kv={bs.block_kv} must be powers of two (Triton blocks)"
        )
    if impl == "reference":
        return bs
    group_pad = next_pow2(dims.num_q_heads // dims.num_kv_heads)
    if not (is_pow2(dims.head_dim) and dims.head_dim >= 16):
        raise ValueError(
            f"the Pallas kernel needs a power-of-two head dim >= 16, got d={dims.head_dim}; use "
            "impl='reference'"
        )
    if impl == "pallas" and (bs.block_q * group_pad < 16 or bs.block_kv < 16):
        raise ValueError(
            f"Triton dots need >= 16 rows and columns: block_q*next_pow2(Hq//Hkv)="
            f"{bs.block_q * group_pad}, block_kv={bs.block_kv}"
        )
    return bs


# --------------------------------------------------------------------------------------------
# Shared metadata handling
# --------------------------------------------------------------------------------------------


class _Schedule(NamedTuple):
    seq: jax.Array  # i32[G]  sequence of each query block; -1 = idle block
    tok0: jax.Array  # i32[G]  first token (row of q) of the block
    ntok: jax.Array  # i32[G]  valid tokens in the block (0 when idle)
    pos0: jax.Array  # i32[G]  absolute KV position of the block's first token


def _num_blocks(num_tokens: int, max_seqs: int, block_q: int) -> int:
    # sum_s ceil(q_s / B) <= sum_s (q_s + B - 1) / B <= (T + S (B - 1)) / B
    return max(1, (num_tokens + max_seqs * (block_q - 1)) // block_q)


def _live_cu(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """cu_q_lens with every dead sequence made empty (garbage metadata is ignored)."""
    idx = jnp.arange(cu_q_lens.shape[0], dtype=jnp.int32)
    return jnp.where(idx <= num_seqs, cu_q_lens, cu_q_lens[num_seqs])


def _schedule(
    cu: jax.Array,  # i32[S+1], dead sequences already emptied by _live_cu
    kv_lens: jax.Array,  # i32[S]
    *,
    num_tokens: int,
    block_q: int,
) -> _Schedule:
    s = kv_lens.shape[0]
    g_total = _num_blocks(num_tokens, s, block_q)
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    nblk = (q_lens + block_q - 1) // block_q
    blk_end = jnp.cumsum(nblk).astype(jnp.int32)
    blk_begin = blk_end - nblk
    g = jnp.arange(g_total, dtype=jnp.int32)
    seq = jnp.searchsorted(blk_end, g, side="right").astype(jnp.int32)
    busy = seq < s
    seq_c = jnp.minimum(seq, s - 1)
    start = (g - blk_begin[seq_c]) * block_q  # offset of the block inside its sequence
    ntok = jnp.where(busy, jnp.clip(q_lens[seq_c] - start, 0, block_q), 0)
    return _Schedule(
        seq=jnp.where(busy & (ntok > 0), seq_c, -1),
        tok0=cu[seq_c] + start,
        ntok=ntok,
        pos0=kv_lens[seq_c] - q_lens[seq_c] + start,
    )


def _token_mask(cu: jax.Array, num_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """bool[T]: token belongs to a live sequence (``cu`` from ``_live_cu``)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return (t >= cu[0]) & (t < cu[num_seqs])


def _prepare_metadata(
    kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any, max_seqs: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    n = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, max_seqs)
    cu = _live_cu(jnp.asarray(cu_q_lens, jnp.int32), n)
    return jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices, jnp.int32), cu, n


# --------------------------------------------------------------------------------------------
# jnp reference
# --------------------------------------------------------------------------------------------


class ReferenceTiling(NamedTuple):
    block_q: int
    group_blocks: int
    kv_chunk: int
    split_kv: bool


def default_reference_tiling(num_tokens: int, max_seqs: int) -> ReferenceTiling:
    """Tiling of the reference (measured on a 2-core CPU, SmolLM2 shapes). Decode-like
    calls (at most two tokens per sequence): one-token blocks, their KV split into 64-token
    work items, 16 items per group, or two per sequence slot when there are fewer slots
    (one sequence of ~90 tokens: 48 us per call with two, 150 us with 16 mostly idle
    lanes). Otherwise 32-token blocks, 8 per group, each walking its KV in 128-token
    chunks."""
    if num_tokens <= 2 * max_seqs:
        return ReferenceTiling(1, min(16, 2 * max_seqs), 64, True)
    return ReferenceTiling(32, 8, 128, False)


def _chunk_table(page_indices: jax.Array, num_pages: int, page_size: int,
                 kv_chunk: int) -> tuple[int, int, jax.Array]:
    """(pages per KV chunk, tokens per chunk, the page table i32[S, width] padded to whole
    chunks with garbage slots clipped into the pool)."""
    pps = page_indices.shape[1]
    chunk_pages = max(1, min(kv_chunk // page_size, pps))
    width = cdiv(pps, chunk_pages) * chunk_pages
    table = jnp.pad(jnp.clip(page_indices, 0, num_pages - 1), ((0, 0), (0, width - pps)))
    return chunk_pages, chunk_pages * page_size, table


def _chunk_softmax(
    qb: jax.Array,  # f32[G, b, Hkv, group, d] scaled queries
    k_rows: jax.Array,  # f[P, page_size * Hkv * d] pages as flat rows
    v_rows: jax.Array,  # f[P, page_size * Hkv * d]
    pages: jax.Array,  # i32[G, chunk_pages] the chunk's pages per block
    visible: jax.Array,  # bool[G, b, chunk] query may see key
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One KV chunk's partial softmax: (o f32[G, b, Hkv, group, d] unnormalised, m the row
    max f32[G, b, Hkv, group] (-inf when all masked), l the row sum)."""
    g, b, hkv, _, d = qb.shape
    k = k_rows[pages].reshape(g, -1, hkv, d)
    v = v_rows[pages].reshape(g, -1, hkv, d)
    hi = lax.Precision.HIGHEST  # no TF32 when this runs on a GPU
    logits = jnp.einsum("gbhjd,glhd->gbhjl", qb, k, preferred_element_type=jnp.float32,
                        precision=hi)
    logits = jnp.where(visible[:, :, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    o = jnp.einsum("gbhjl,glhd->gbhjd", probs, v, preferred_element_type=jnp.float32,
                   precision=hi)
    return o, m, jnp.sum(probs, axis=-1)


def _blocks_to_rows(q: jax.Array, o: jax.Array, sch: _Schedule) -> jax.Array:
    """Per-block outputs f32[G, b, Hq, d] back to the token rows f[T, Hq, d] (others 0)."""
    t = q.shape[0]
    offs = jnp.arange(o.shape[1], dtype=jnp.int32)
    ok = (sch.seq >= 0)[:, None] & (offs[None] < sch.ntok[:, None])
    rows = jnp.where(ok, sch.tok0[:, None] + offs, t)
    return jnp.zeros_like(q).at[rows].set(o.astype(q.dtype), mode="drop")


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "block_q", "group_blocks", "kv_chunk", "split_kv")
)
def _rpa_reference(
    q: jax.Array,  # f[T, Hq, d]
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    block_q: int,
    group_blocks: int,
    kv_chunk: int,
    split_kv: bool,
) -> jax.Array:  # f[T, Hq, d]
    if split_kv:
        return _rpa_reference_split_kv(
            q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, block_q=block_q, group_size=group_blocks, kv_chunk=kv_chunk)
    t, hq, d = q.shape
    p, ps, hkv, _ = k_pages.shape
    s, pps = page_indices.shape
    group = hq // hkv
    b = block_q
    kv_lens, page_indices, cu, n = _prepare_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, s)
    sch = _schedule(cu, kv_lens, num_tokens=t, block_q=b)  # live blocks first, idle after
    g_total = sch.seq.shape[0]
    gb = min(group_blocks, g_total)
    pad = cdiv(g_total, gb) * gb - g_total
    live = jnp.pad(sch.seq >= 0, (0, pad))
    seq, tok0, pos0 = (jnp.pad(x, (0, pad)) for x in (jnp.maximum(sch.seq, 0), sch.tok0,
                                                       sch.pos0))
    chunk_pages, chunk, table = _chunk_table(page_indices, p, ps, kv_chunk)
    offs = jnp.arange(b, dtype=jnp.int32)
    kv_end = jnp.where(live, pos0 + jnp.pad(sch.ntok, (0, pad)), 0)  # keys: [0, kv_end)
    # Pages as flat rows: callers that hold one pool under several page shapes (the Conflux
    # step's prefill and decode views) then hand every loop the same buffer, which XLA
    # would otherwise copy whole into each loop that reads a differently shaped view.
    k_rows, v_rows = k_pages.reshape(p, -1), v_pages.reshape(p, -1)

    def block_group(i: jax.Array, out: jax.Array) -> jax.Array:
        def take(x: jax.Array) -> jax.Array:
            return lax.dynamic_slice_in_dim(x, i * gb, gb)

        r, sq, first, end = take(tok0)[:, None] + offs, take(seq), take(pos0), take(kv_end)
        qb = q[jnp.clip(r, 0, t - 1)].astype(jnp.float32) * sm_scale
        qb = qb.reshape(gb, b, hkv, group, d)
        tbl = table[sq]  # i32[gb, width]
        q_pos = first[:, None] + offs  # i32[gb, b]

        def kv_block(c: jax.Array, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
            acc, m, l_sum = state  # f32[gb, b, Hkv, group, d], f32[gb, b, Hkv, group] x2
            pages = lax.dynamic_slice_in_dim(tbl, c * chunk_pages, chunk_pages, axis=1)
            key_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            o_c, m_c, l_c = _chunk_softmax(qb, k_rows, v_rows, pages,
                                           key_pos[None, None, :] <= q_pos[:, :, None])
            m_next = jnp.maximum(m, m_c)  # online softmax: rescale both sides to m_next
            m_safe = jnp.where(jnp.isfinite(m_next), m_next, 0.0)  # no NaN while all masked
            alpha, beta = jnp.exp(m - m_safe), jnp.exp(m_c - m_safe)
            return (alpha[..., None] * acc + beta[..., None] * o_c, m_next,
                    alpha * l_sum + beta * l_c)

        state = (
            jnp.zeros((gb, b, hkv, group, d), jnp.float32),
            jnp.full((gb, b, hkv, group), -jnp.inf, jnp.float32),
            jnp.zeros((gb, b, hkv, group), jnp.float32),
        )
        acc, _, l_sum = lax.fori_loop(0, cdiv(jnp.max(end), chunk), kv_block, state)
        o = acc / jnp.where(l_sum == 0, 1.0, l_sum)[..., None]
        return lax.dynamic_update_slice_in_dim(out, o.reshape(gb, b, hq, d), i * gb, 0)

    num_live = jnp.sum(live.astype(jnp.int32))
    blocks = lax.fori_loop(0, cdiv(num_live, gb), block_group,
                           jnp.zeros((g_total + pad, b, hq, d), jnp.float32))
    return _blocks_to_rows(q, blocks[:g_total], sch)


def _rpa_reference_split_kv(
    q: jax.Array,  # f[T, Hq, d]
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[]
    *,
    sm_scale: float,
    block_q: int,
    group_size: int,
    kv_chunk: int,
) -> jax.Array:  # f[T, Hq, d]
    """Flash-decoding form: every (query block, KV chunk) pair is one work item; items run
    ``group_size`` at a time and each group's partial softmaxes are merged into their
    blocks. Work follows the summed live lengths, however unequal (one long sequence is
    split over a whole group instead of walked chunk by chunk)."""
    t, hq, d = q.shape
    p, ps, hkv, _ = k_pages.shape
    s, pps = page_indices.shape
    group = hq // hkv
    b, gw = block_q, group_size
    kv_lens, page_indices, cu, n = _prepare_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, s)
    sch = _schedule(cu, kv_lens, num_tokens=t, block_q=b)  # live blocks first, idle after
    g_total = sch.seq.shape[0]
    live = sch.seq >= 0
    seq = jnp.maximum(sch.seq, 0)
    chunk_pages, chunk, table = _chunk_table(page_indices, p, ps, kv_chunk)
    n_chunks = (jnp.where(live, sch.pos0 + sch.ntok, 0) + chunk - 1) // chunk  # i32[G]
    items_end = jnp.cumsum(n_chunks).astype(jnp.int32)  # items are block-major
    items_begin = items_end - n_chunks
    total = items_end[-1]
    offs = jnp.arange(b, dtype=jnp.int32)
    lane = jnp.arange(gw, dtype=jnp.int32)
    k_rows, v_rows = k_pages.reshape(p, -1), v_pages.reshape(p, -1)  # see _rpa_reference

    def item_group(i: jax.Array, state: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        acc, m_acc, l_acc = state  # f32[G+gw, b, Hkv, group, d], f32[G+gw, b, Hkv, group] x2
        item = i * gw + lane
        blk = jnp.minimum(jnp.searchsorted(items_end, item, side="right"), g_total - 1)
        blk = blk.astype(jnp.int32)
        c = item - items_begin[blk]  # KV chunk of the item within its block's sequence
        qb = q[jnp.clip(sch.tok0[blk][:, None] + offs, 0, t - 1)].astype(jnp.float32)
        qb = qb.reshape(gw, b, hkv, group, d) * sm_scale
        q_pos = sch.pos0[blk][:, None] + offs  # i32[gw, b]
        pages = table[seq[blk][:, None], c[:, None] * chunk_pages + jnp.arange(chunk_pages)]
        key_pos = c[:, None] * chunk + jnp.arange(chunk, dtype=jnp.int32)  # i32[gw, chunk]
        visible = (key_pos[:, None, :] <= q_pos[:, :, None]) & (item < total)[:, None, None]
        o, m, l_item = _chunk_softmax(qb, k_rows, v_rows, pages, visible)
        # Merge into the blocks blk[0] .. blk[0] + gw - 1 (block-major items span at most
        # gw blocks): first the group's items per block, then with what the block had.
        local = blk - blk[0]
        m_old = lax.dynamic_slice_in_dim(m_acc, blk[0], gw)
        m_new = jnp.maximum(m_old, jax.ops.segment_max(m, local, num_segments=gw))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        scale = jnp.exp(m - m_safe[local])
        o_sum = jax.ops.segment_sum(o * scale[..., None], local, num_segments=gw)
        l_sum = jax.ops.segment_sum(l_item * scale, local, num_segments=gw)
        keep = jnp.exp(m_old - m_safe)
        a_old = lax.dynamic_slice_in_dim(acc, blk[0], gw)
        l_old = lax.dynamic_slice_in_dim(l_acc, blk[0], gw)
        return (
            lax.dynamic_update_slice_in_dim(acc, a_old * keep[..., None] + o_sum, blk[0], 0),
            lax.dynamic_update_slice_in_dim(m_acc, m_new, blk[0], 0),
            lax.dynamic_update_slice_in_dim(l_acc, l_old * keep + l_sum, blk[0], 0),
        )

    rows = g_total + gw  # spare rows: every group's window of gw blocks fits
    state = (
        jnp.zeros((rows, b, hkv, group, d), jnp.float32),
        jnp.full((rows, b, hkv, group), -jnp.inf, jnp.float32),
        jnp.zeros((rows, b, hkv, group), jnp.float32),
    )
    acc, _, l_acc = lax.fori_loop(0, (total + gw - 1) // gw, item_group, state)
    o = (acc / jnp.where(l_acc == 0, 1.0, l_acc)[..., None])[:g_total]
    return _blocks_to_rows(q, o.reshape(g_total, b, hq, d), sch)


def ragged_paged_attention_reference(
    q: jax.Array,  # f[T, Hq, d]
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    kv_lens: jax.Array,  # i32[S]
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1]
    num_seqs: jax.Array,  # i32[] or i32[1]
    *,
    sm_scale: float | None = None,
    block_q: int | None = None,
    group_blocks: int | None = None,
    kv_chunk: int | None = None,
    split_kv: bool | None = None,
) -> jax.Array:  # f[T, Hq, d]
    """Pure-``jnp`` ragged paged attention (same contract as ``ragged_paged_attention``).

    Splits the queries into the kernel's blocks (``block_q`` tokens of one sequence) and
    runs them ``group_blocks`` at a time, vectorized: a group walks the KV in chunks of
    ``kv_chunk`` tokens (rounded to whole pages), gathering each block's pages, up to the
    furthest position any of its blocks sees, with an online softmax. Idle blocks (the
    schedule's padding) come last and whole groups of them are skipped, so the work follows
    the live lengths, not the page table's width. With ``split_kv`` (the default for
    decode-like calls) each (block, chunk) pair is instead one work item, ``group_blocks``
    items run at a time and partial softmaxes are merged per block (flash-decoding), so
    unequal lengths cost their sum. The options only trade loop trips for array sizes
    (defaults: ``default_reference_tiling``). Pool entries past a block's last
    position inside its last chunk are read (and masked), so they must be finite (a
    zero-initialised pool is); the Pallas kernel never reads them.
    """
    dims = _validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale)
    tiling = default_reference_tiling(dims.num_tokens, dims.max_seqs)
    block_q = tiling.block_q if block_q is None else block_q
    group_blocks = tiling.group_blocks if group_blocks is None else group_blocks
    kv_chunk = tiling.kv_chunk if kv_chunk is None else kv_chunk
    split_kv = tiling.split_kv if split_kv is None else bool(split_kv)
    for name, value in (("block_q", block_q), ("group_blocks", group_blocks),
                        ("kv_chunk", kv_chunk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    scale = 1.0 / math.sqrt(dims.head_dim) if sm_scale is None else float(sm_scale)
    return _rpa_reference(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=scale,
        block_q=block_q,
        group_blocks=group_blocks,
        kv_chunk=kv_chunk,
        split_kv=split_kv,
    )


# --------------------------------------------------------------------------------------------
# Pallas kernel
# --------------------------------------------------------------------------------------------


def _rpa_kernel(
    seq_ref: Any,  # i32[G]  sequence of each query block, -1 = idle
    tok0_ref: Any,  # i32[G]  first token of the block
    ntok_ref: Any,  # i32[G]  valid tokens in the block
    pos0_ref: Any,  # i32[G]  absolute position of the block's first token
    page_table_ref: Any,  # i32[S, pages_per_seq]  already clipped to [0, P)
    q_ref: Any,  # f[T*Hq, d]
    k_ref: Any,  # f[P*page_size, Hkv, d]
    v_ref: Any,  # f[P*page_size, Hkv, d]
    *out_refs: Any,  # kv_splits == 1: o f[T*Hq, d]
    # else: o f32[splits, T*Hq, d] (normalised per split), m f32[splits, T*Hq], l (same)
    sm_scale: float,
    group: int,
    group_pad: int,
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
        rows_per_block = block_q * group_pad
        tok0, ntok, pos0 = tok0_ref[blk], ntok_ref[blk], pos0_ref[blk]

        # Row r of the block is query token r // group_pad, head h*group + r % group_pad.
        r = lax.iota(jnp.int32, rows_per_block)
        t_local, g = lax.div(r, group_pad), lax.rem(r, group_pad)
        row_ok = (t_local < ntok) & (g < group)
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
            s = plgpu.dot(q, k, trans_b=True, precision=lax.Precision.HIGHEST) * scale
            if masked:
                s = jnp.where(kv_pos[None, :] <= q_pos[:, None], s, _MASK_VALUE)
            m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
            alpha = jnp.exp2(m_prev - m_next)
            prob = jnp.exp2(s - m_next[:, None])
            l_next = alpha * l_prev + jnp.sum(prob, axis=1)
            pv = plgpu.dot(prob.astype(v.dtype), v, precision=lax.Precision.HIGHEST)
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
def _rpa_pallas(
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
    plgpu = triton_module()
    t, hq, d = q.shape
    p, ps, hkv, _ = k_pages.shape
    s, _ = page_indices.shape
    group = hq // hkv
    kv_lens, page_indices, cu, n = _prepare_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, s)
    sch = _schedule(cu, kv_lens, num_tokens=t, block_q=bs.block_q)
    num_blocks = sch.seq.shape[0]
    # Garbage entries (unused slots, dead sequences) must never address outside the pool.
    page_table = jnp.clip(page_indices, 0, p - 1)
    rows = t * hq

    kernel = functools.partial(
        _rpa_kernel,
        sm_scale=sm_scale,
        group=group,
        group_pad=next_pow2(group),
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
    out = jnp.where(_token_mask(cu, n, t)[:, None, None], out.reshape(t, hq, d), 0)
    return out.astype(q.dtype)


# --------------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------------


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
      impl: None (auto; ``$CONFLUX_ATTENTION_IMPL`` overrides), "reference", "pallas" or
        "interpret".
      **block_sizes: Pallas tiling overrides, any of block_q, block_kv, kv_splits, num_warps,
        num_stages (see ``BlockSizes``; defaults from ``default_block_sizes``). The reference
        accepts and ignores them.

    Returns:
      f[T, Hq, d]; rows of tokens outside live sequences (>= cu_q_lens[num_seqs]) are 0.

    Raises:
      ValueError: inconsistent shapes or dtypes, or (when the metadata is concrete rather than
        traced) inconsistent values, before anything is traced.
    """
    dims = _validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale)
    impl = resolve_impl(impl)
    bs = _block_sizes(dims, impl, block_sizes)
    scale = 1.0 / math.sqrt(dims.head_dim) if sm_scale is None else float(sm_scale)
    if impl == "reference":
        tiling = default_reference_tiling(dims.num_tokens, dims.max_seqs)
        return _rpa_reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                              sm_scale=scale, **tiling._asdict())
    return _rpa_pallas(
        q,
        k_pages,
        v_pages,
        kv_lens,
        page_indices,
        cu_q_lens,
        num_seqs,
        sm_scale=scale,
        bs=bs,
        interpret=impl == "interpret",
    )
