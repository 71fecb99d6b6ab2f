"""The tiled XLA path: ragged paged attention in pure ``jnp`` (``impl="xla"``; the fast path on
CPU).

Prefill: the queries are cut into the schedule's blocks (32 tokens by default), which run a
group at a time, vectorized over the group, over their pages in chunks of 128 tokens up to the
group's furthest position, with an online softmax; groups of idle blocks are skipped. Decode
(split-KV, flash-decoding): every (query block, 128-token KV chunk) pair is a work item, items
run a group at a time and their partial softmaxes are merged per block. Either way the cost
follows the live lengths, not the page table's width.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._common import cdiv
from pallas_kernels.ragged_paged_attention.schedule import (
    Schedule,
    build_schedule,
    prepare_metadata,
    short_queries,
)
from pallas_kernels.ragged_paged_attention.validation import softmax_scale, validate

__all__ = ["XlaTiling", "default_xla_tiling", "ragged_paged_attention_xla", "rpa_xla"]


class XlaTiling(NamedTuple):
    """Loop shape of the XLA path; only a speed knob (see ``ragged_paged_attention_xla``)."""

    block_q: int
    group_blocks: int
    kv_chunk: int
    split_kv: bool


def default_xla_tiling(num_tokens: int, max_seqs: int, query_len: str | None = None
                       ) -> XlaTiling:
    """Tiling of the XLA path (measured on a 2-core CPU, SmolLM2 shapes). Decode-like
    calls (at most two tokens per sequence): one-token blocks, their KV split into 64-token
    work items, 16 items per group, or two per sequence slot when there are fewer slots
    (one sequence of ~90 tokens: 48 us per call with two, 150 us with 16 mostly idle
    lanes). Otherwise 32-token blocks, each walking its KV in 128-token chunks, one block
    per group per 64 query rows (1 to 8): a group computes all its blocks, idle or not, and
    a 64-row call holds at most a few live ones (one 32-token prompt: 0.48 ms a call with
    one block per group, 2.5 ms with 8; 256 rows of two 128-token prompts: 1.9 ms with 4
    or 8, 2.6 with 1). ``query_len`` overrides the guess from the shapes
    (:func:`~pallas_kernels.ragged_paged_attention.schedule.short_queries`)."""
    if short_queries(num_tokens, max_seqs, query_len):
        return XlaTiling(1, min(16, 2 * max_seqs), 64, True)
    return XlaTiling(32, max(1, min(8, num_tokens // 64)), 128, False)


def _chunk_table(page_indices: jax.Array, num_pages: int, page_size: int,
                 kv_chunk: int) -> tuple[int, int, jax.Array]:
    """(pages per KV chunk, tokens per chunk, the page table i32[S, width] padded to whole
    chunks with garbage slots clipped into the pool)."""
    pps = page_indices.shape[1]
    chunk_pages = max(1, min(kv_chunk // page_size, pps))
    width = cdiv(pps, chunk_pages) * chunk_pages
    table = jnp.pad(jnp.clip(page_indices, 0, num_pages - 1), ((0, 0), (0, width - pps)))
    return chunk_pages, chunk_pages * page_size, table


def _page_rows(k_pages: jax.Array, v_pages: jax.Array | None) -> tuple[jax.Array, ...]:
    """Pages as flat rows, (K f[P, page_size * Hkv * d], V) or, for a combined pool
    (``v_pages`` None), (KV f[P, page_size * 2*Hkv * d],). One buffer per pool: callers
    that hold a pool under several page shapes (the Conflux step's prefill and decode
    views) then hand every loop the same buffer, which XLA would otherwise copy whole into
    each loop that reads a differently shaped view."""
    p = k_pages.shape[0]
    if v_pages is None:
        return (k_pages.reshape(p, -1),)
    return k_pages.reshape(p, -1), v_pages.reshape(p, -1)


def _kv_heads(k_pages: jax.Array, v_pages: jax.Array | None) -> int:
    """Hkv of the pools (a combined pool holds two slots per head)."""
    return k_pages.shape[2] // (2 if v_pages is None else 1)


def _chunk_softmax(
    qb: jax.Array,  # f32[G, b, Hkv, group, d] scaled queries
    rows: tuple[jax.Array, ...],  # ``_page_rows``: K and V, or the combined pool
    pages: jax.Array,  # i32[G, chunk_pages] the chunk's pages per block
    visible: jax.Array,  # bool[G, b, chunk] query may see key
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One KV chunk's partial softmax: (o f32[G, b, Hkv, group, d] unnormalised, m the row
    max f32[G, b, Hkv, group] (-inf when all masked), l the row sum)."""
    g, b, hkv, _, d = qb.shape
    if len(rows) == 1:  # combined: the chunk's pages gathered once, then K and V apart
        kv = rows[0][pages].reshape(g, -1, 2 * hkv, d)
        k, v = kv[:, :, 0::2], kv[:, :, 1::2]
    else:
        k = rows[0][pages].reshape(g, -1, hkv, d)
        v = rows[1][pages].reshape(g, -1, hkv, d)
    # fp32 KV gets exact fp32 dots (no TF32 on a GPU, no bf16 passes on a TPU): the tests'
    # tolerance. bf16 KV takes the default: its values are exact in TF32 and the sums are
    # fp32 either way (preferred_element_type), so HIGHEST would only cost time.
    hi = lax.Precision.HIGHEST if k.dtype == jnp.float32 else lax.Precision.DEFAULT
    logits = _block_einsum("gbhjd,glhd->gbhjl", qb, k, hi)
    logits = jnp.where(visible[:, :, None, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1)
    probs = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    o = _block_einsum("gbhjl,glhd->gbhjd", probs, v, hi)
    return o, m, jnp.sum(probs, axis=-1)


def _block_einsum(spec: str, a: jax.Array, kv: jax.Array, precision: lax.Precision) -> jax.Array:
    """``einsum(spec, a, kv)`` in fp32, ``a``'s axis 1 the query block ``b``. A unit block
    (decode) is dropped first: the dots are then plain batched matmuls over (block, KV
    head), which XLA:CPU runs ~2x faster."""
    if a.shape[1] == 1:
        out = jnp.einsum(spec.replace("b", ""), a[:, 0], kv,
                         preferred_element_type=jnp.float32, precision=precision)
        return out[:, None]
    return jnp.einsum(spec, a, kv, preferred_element_type=jnp.float32, precision=precision)


def _blocks_to_rows(q: jax.Array, o: jax.Array, sch: Schedule) -> jax.Array:
    """Per-block outputs f32[G, b, Hq, d] back to the token rows f[T, Hq, d] (others 0)."""
    t = q.shape[0]
    offs = jnp.arange(o.shape[1], dtype=jnp.int32)
    ok = (sch.seq >= 0)[:, None] & (offs[None] < sch.ntok[:, None])
    rows = jnp.where(ok, sch.tok0[:, None] + offs, t)
    return jnp.zeros_like(q).at[rows].set(o.astype(q.dtype), mode="drop")


@functools.partial(
    jax.jit, static_argnames=("sm_scale", "block_q", "group_blocks", "kv_chunk", "split_kv")
)
def rpa_xla(
    q: jax.Array,  # f[T, Hq, d]
    k_pages: jax.Array,  # f[P, page_size, Hkv, d], or the combined pool f[P, ps, 2*Hkv, d]
    v_pages: jax.Array | None,  # f[P, page_size, Hkv, d]; None with the combined pool
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
    """Jitted core of the XLA path: inputs already validated, ``sm_scale`` resolved; K and V
    pools, or one combined pool (``combined.py``) as ``k_pages`` with ``v_pages`` None."""
    if split_kv:
        return _rpa_xla_split_kv(
            q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
            sm_scale=sm_scale, block_q=block_q, group_size=group_blocks, kv_chunk=kv_chunk)
    t, hq, d = q.shape
    p, ps, _, _ = k_pages.shape
    hkv = _kv_heads(k_pages, v_pages)
    s, pps = page_indices.shape
    group = hq // hkv
    b = block_q
    kv_lens, page_indices, cu, n = prepare_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, s)
    sch = build_schedule(cu, kv_lens, num_tokens=t, block_q=b)  # live blocks first, idle after
    g_total = sch.seq.shape[0]
    gb = min(group_blocks, g_total)
    pad = cdiv(g_total, gb) * gb - g_total
    live = jnp.pad(sch.seq >= 0, (0, pad))
    seq, tok0, pos0 = (jnp.pad(x, (0, pad)) for x in (jnp.maximum(sch.seq, 0), sch.tok0,
                                                       sch.pos0))
    chunk_pages, chunk, table = _chunk_table(page_indices, p, ps, kv_chunk)
    offs = jnp.arange(b, dtype=jnp.int32)
    kv_end = jnp.where(live, pos0 + jnp.pad(sch.ntok, (0, pad)), 0)  # keys: [0, kv_end)
    rows = _page_rows(k_pages, v_pages)

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
            o_c, m_c, l_c = _chunk_softmax(qb, rows, pages,
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


def _rpa_xla_split_kv(
    q: jax.Array,  # f[T, Hq, d]
    k_pages: jax.Array,  # f[P, page_size, Hkv, d] (or combined: see rpa_xla)
    v_pages: jax.Array | None,  # f[P, page_size, Hkv, d]
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
    p, ps, _, _ = k_pages.shape
    hkv = _kv_heads(k_pages, v_pages)
    s, pps = page_indices.shape
    group = hq // hkv
    b, gw = block_q, group_size
    kv_lens, page_indices, cu, n = prepare_metadata(kv_lens, page_indices, cu_q_lens, num_seqs, s)
    sch = build_schedule(cu, kv_lens, num_tokens=t, block_q=b)  # live blocks first, idle after
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
    rows_kv = _page_rows(k_pages, v_pages)

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
        o, m, l_item = _chunk_softmax(qb, rows_kv, pages, visible)
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


def ragged_paged_attention_xla(
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
    """The XLA path of ``ragged_paged_attention`` (same contract), with its loop shape exposed.

    Splits the queries into the kernel's blocks (``block_q`` tokens of one sequence) and
    runs them ``group_blocks`` at a time, vectorized: a group walks the KV in chunks of
    ``kv_chunk`` tokens (rounded to whole pages), gathering each block's pages, up to the
    furthest position any of its blocks sees, with an online softmax. Idle blocks (the
    schedule's padding) come last and whole groups of them are skipped, so the work follows
    the live lengths, not the page table's width. With ``split_kv`` (the default for
    decode-like calls) each (block, chunk) pair is instead one work item, ``group_blocks``
    items run at a time and partial softmaxes are merged per block (flash-decoding), so
    unequal lengths cost their sum. The options only trade loop trips for array sizes
    (defaults: ``default_xla_tiling``). Pool entries past a block's last
    position inside its last chunk are read (and masked), so they must be finite (a
    zero-initialised pool is); the Pallas kernel never reads them.
    """
    dims = validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale)
    tiling = default_xla_tiling(dims.num_tokens, dims.max_seqs)
    block_q = tiling.block_q if block_q is None else block_q
    group_blocks = tiling.group_blocks if group_blocks is None else group_blocks
    kv_chunk = tiling.kv_chunk if kv_chunk is None else kv_chunk
    split_kv = tiling.split_kv if split_kv is None else bool(split_kv)
    for name, value in (("block_q", block_q), ("group_blocks", group_blocks),
                        ("kv_chunk", kv_chunk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    scale = softmax_scale(dims, sm_scale)
    return rpa_xla(
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
