"""The Conflux step: one ``shard_map`` program that co-batches prefill and decode.

Per rank and per layer (DESIGN.md §3, paper §4):

1. QKV on the rank's whole token buffer (prefill + decode tokens: one GEMM).
2. Prefill slice ``[P]``: all-to-all over ``sp`` (sequence-sharded -> head-sharded), write
   K/V into this rank's head-sharded pages (the prefill view of the pool), ragged paged
   attention over every prefill sequence of the iteration, all-to-all back. A chunk after
   a prefix-cache hit first receives its cached prefix's head shard from the owner rank
   (one all-to-all into this rank's prefill pages). Requests whose
   final chunk ran move their KV, page group by page group, to their decode rank only (a
   ragged all-to-all sized by the groups that complete; none compiled when none do).
3. Decode slice ``[D]``: write K/V into rank-local full-head pages, paged attention over
   the rank's own decode requests; a prefix hit's suffix prefilled on its owner alone is
   one ragged sequence there (its rows after the decodes') over the cached pages.
4. O projection and FFN on the whole buffer again. Logits only for the sampling rows.

A step is two pure functions, each one compiled executable: the forward
``(params, kv_pools, RankInputs, SharedInputs, fed) -> ForwardOutputs`` (KV donated) and
the sampler ``(logits, SampleRows) -> (SampledRows packed, tokens)``. The host dispatches
the forward, fills the token masks of grammar-constrained rows while the device runs it,
then dispatches the sampler (vLLM's overlap of the structured-output bitmask with the
forward pass); an unconstrained step dispatches both at once and reads its tokens once.
The sampler's ``tokens`` (i32[N, R_max], padded) may be the next step's ``fed``: its
decode rows then read their input tokens on the device (``RankInputs.token_from``), so the
host launches that step before this one's tokens reach it (vLLM's async scheduling).

The KV lives in two pools, K and V (``kv_layout="split"``), or in one combined pool with K
and V of each head side by side (``"combined"``, the layout of JAX's TPU kernel; see
``pallas_kernels.ragged_paged_attention.combined``). Every write, transfer and prefix-cache
load treats each pool alike: a contiguous head shard of the combined pool is whole K/V pairs.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from conflux_jax.config import ModelConfig
from conflux_jax.executor.batch import (
    ForwardOutputs,
    Packed,
    PackedSample,
    RankInputs,
    SampledRows,
    SampleRows,
    SharedInputs,
    StepBatch,
    unpacked,
)
from conflux_jax.executor.mesh import SP, TP
from conflux_jax.models.decoder import Decoder
from conflux_jax.models.params import Params, layers_unstacked
from conflux_jax.sampling import LogitAdjustments, sample
from pallas_kernels.cpu_attention import (
    paged_copy_pages,
    paged_decode,
    paged_kv_write,
    paged_prefill,
)
from pallas_kernels.ragged_paged_attention import (
    combine_kv,
    ragged_paged_attention,
    ragged_paged_attention_combined,
)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static facts the compiled step depends on (hashable: part of the jit cache key)."""

    model: ModelConfig  # head counts already padded for the mesh
    num_ranks: int  # N = sp
    tp: int
    page_size: int
    num_pages: int  # pages per rank
    num_top_logprobs: int = 0
    attention_impl: str | None = None  # None = auto (see pallas_kernels)
    linears: str = "xla"  # "blas": OpenBLAS in place of XLA's dot (``Decoder.run_layers``)
    # "cpu": decode / prefill attention by the CPU's FFI handlers
    # (``pallas_kernels.cpu_attention``) instead of ``ragged_paged_attention``.
    decode_attention: str = "rpa"
    prefill_attention: str = "rpa"
    # "cpu": new K/V rows written by the CPU's FFI handler (``paged_kv_write``) instead of
    # XLA's scatter (14 ms of a 512-token SmolLM2 prefill step on a 2-core host).
    kv_write: str = "xla"
    kv_layout: str = "split"  # "split": K and V pools; "combined": one (see the docstring)
    # Multi-process: the sampler returns its rows replicated (see ``build_step``).
    replicate_samples: bool = False
    # R_max: the most sampling rows of any step shape. The sampler also returns its tokens
    # padded to it, which the next step's forward may take as its ``fed`` argument.
    max_sample_rows: int = 1


def kv_pool_shape(cfg: StepConfig) -> tuple[int, ...]:
    """Global shape of each KV pool: f[N, L, pages, page_size, Hkv, d] (K or V), or
    f[N, L, pages, page_size, 2*Hkv, d] (the combined pool)."""
    m = cfg.model
    heads = m.num_kv_heads * (2 if cfg.kv_layout == "combined" else 1)
    return (cfg.num_ranks, m.num_layers, cfg.num_pages, cfg.page_size, heads, m.head_dim)


def num_kv_pools(cfg: StepConfig) -> int:
    """2 (K, V) or 1 (combined)."""
    return 1 if cfg.kv_layout == "combined" else 2


KV_POOL_SPEC = P(SP, None, None, None, TP, None)
ATTENTION = ("rpa", "cpu")
KV_LAYOUTS = ("split", "combined")


def transfer_link_bytes(cfg: StepConfig, groups: int, itemsize: int) -> int:
    """Bytes ``groups`` moved page groups send over links in one step (K and V, all
    layers): a group is N decode pages of all heads, of which the decode rank already
    holds one head shard (N-1 cross a link)."""
    m = cfg.model
    page = cfg.page_size * m.num_kv_heads * m.head_dim * itemsize
    return 2 * m.num_layers * groups * (cfg.num_ranks - 1) * page


def param_specs(params: Params) -> Params:
    """Weights replicated over sp; QKV/gate/up column-parallel and O/down row-parallel
    over tp; embeddings, norms and the LM head replicated. Layer weights stacked or per
    layer (``models.params.unstack_layers``)."""
    column = {"wq", "wk", "wv", "w_gate", "w_up", "wqkv"}
    row = {"wo", "w_down"}
    per_layer = layers_unstacked(params)
    lead = () if per_layer else (None,)  # the stacked layer axis

    def spec(name: str) -> P:
        if name in column:
            return P(*lead, None, TP)
        if name in row:
            return P(*lead, TP, None)
        return P()

    out: dict[str, Any] = {k: P() for k in params if k != "layers"}
    out["layers"] = (tuple({k: spec(k) for k in w} for w in params["layers"]) if per_layer
                     else {k: spec(k) for k in params["layers"]})
    return out


def _rank_forward(cfg: StepConfig, params: Params, kv_pools: tuple[jax.Array, ...],
                  rank: RankInputs | Packed, meta: SharedInputs | Packed,
                  fed: jax.Array) -> ForwardOutputs:
    """The forward's body on every device. Per-rank arrays arrive with a leading axis of
    size 1, as they are or packed (what the executor sends: one buffer each). ``fed``
    i32[1, R_max]: the previous step's sampled tokens on this rank, read by the rows that
    ``token_from`` names (any values when none does)."""
    n, ps = cfg.num_ranks, cfg.page_size
    rank, meta = unpacked(rank), unpacked(meta)
    b = jax.tree.map(lambda a: a[0], rank)  # this rank's inputs
    pools = tuple(pool[0] for pool in kv_pools)  # each f[L, pages, ps, H_local, d]
    model = Decoder(cfg.model, params)
    t = b.tokens.shape[0]
    p = meta.perm.shape[0] // n
    d_slots = b.decode_index.shape[0]
    x_groups = b.transfer_src.shape[0]
    decode_cu = jnp.arange(d_slots + 1, dtype=jnp.int32)
    combined = cfg.kv_layout == "combined"
    rpa = functools.partial(ragged_paged_attention_combined if combined
                            else ragged_paged_attention, impl=cfg.attention_impl)
    attn = _cpu_prefill if cfg.prefill_attention == "cpu" else rpa
    decode_attn = _cpu_decode if cfg.decode_attention == "cpu" else rpa
    cpu_kv = cfg.kv_write == "cpu"

    def pool_rows(k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
        """What each pool stores of K and V f[T, Hkv, d]: (K, V) or (K/V interleaved,)."""
        return (combine_kv(k, v),) if combined else (k, v)

    def attend(layer, q, k, v, kv):
        # each pool f[L, pages, ps, H_l, d]: written in place, read one layer at a time
        kv = tuple(kv)
        _, pages, _, heads, hd = kv[0].shape
        base = layer * pages
        view = (pages, ps * n, heads // n, hd)  # prefill view (KV aliasing: a free reshape)
        # Every write of the layer comes before every read: an in-place write after an
        # attention loop has read the pool makes XLA copy the whole pool.
        if p:
            def to_heads(a):  # [P, H, d] -> [N*P, H/N, d] in kernel order
                if n == 1:  # one rank fills its slots in kernel order: perm is the identity
                    return a[:p]
                a = jax.lax.all_to_all(a[:p], SP, split_axis=1, concat_axis=0, tiled=True)
                return a[meta.perm]

            qa = to_heads(q)
            rows = tuple(to_heads(a) for a in pool_rows(k, v))
            # One rank on the CPU: loads and transfers are page copies within the pool.
            copy_pages = x_groups and cpu_kv and n == 1
            if copy_pages:
                kv = tuple(paged_copy_pages(pool, layer, b.load_src, 0, b.load_dst,
                                            meta.load_count[0]) for pool in kv)
            elif x_groups:
                kv = tuple(_load_cached(pool, layer, base, b, meta, view, cpu_kv)
                           for pool in kv)
            kv = tuple(_write_stacked(pool, layer, r, b.prefill_slot, view, cpu_kv)
                       for pool, r in zip(kv, rows, strict=True))
            if copy_pages:
                kv = tuple(paged_copy_pages(pool, layer, b.transfer_src, meta.transfer_start[0],
                                            b.transfer_dst, meta.transfer_count[0])
                           for pool in kv)
            elif x_groups:
                kv = tuple(_transfer(_layers_as_pages(pool, view), pool, layer, base, b, meta)
                           for pool in kv)
        idx = jnp.minimum(b.decode_index, t - 1)
        kv = tuple(_write_stacked(pool, layer, r, b.decode_slot, pool.shape[1:], cpu_kv)
                   for pool, r in zip(kv, pool_rows(k[idx], v[idx]), strict=True))
        # Attention reads the stacked pool through page ids offset to this layer: slicing
        # the layer out first would copy a whole layer of KV per layer.
        out = jnp.zeros_like(q)
        if p:
            o = attn(qa, *(_layers_as_pages(pool, view) for pool in kv),
                     meta.kv_lens, b.prefill_pages + base, meta.cu_q_lens, meta.num_seqs)
            if n > 1:
                o = jax.lax.all_to_all(o[meta.inverse], SP, split_axis=0, concat_axis=1,
                                       tiled=True)  # [P, Hq_l, d], sequence-sharded again
            out = out.at[:p].set(o)
        dec = tuple(_layers_as_pages(pool, pool.shape[1:]) for pool in kv)
        od = decode_attn(q[idx], *dec, b.decode_kv_len, b.decode_pages + base,
                         decode_cu, b.num_decode[None])
        out = out.at[b.decode_index].set(od, mode="drop")
        # Owner-alone suffixes: each a ragged sequence over its rank's full-head pages (the
        # prefix and itself, causal), computed only in steps that have one.
        lidx = jnp.minimum(b.local_index, t - 1)
        ol = jax.lax.cond(
            b.num_local > 0,
            lambda: attn(q[lidx], *dec, b.local_kv_len, b.local_pages + base,
                         b.local_cu, b.num_local[None], query_len="long"),
            lambda: jnp.zeros((lidx.shape[0], *q.shape[1:]), q.dtype))
        out = out.at[b.local_index].set(ol, mode="drop")
        return out, kv

    # Rows not fed (-1) scatter to T: dropped.
    fed_at = jnp.where(b.token_from >= 0, b.sample_index, t)
    tokens = b.tokens.at[fed_at].set(fed[0][jnp.maximum(b.token_from, 0)], mode="drop")
    x = model.embed_tokens(tokens)
    tp_axis = TP if cfg.tp > 1 else None
    x, pools = model.run_layers(x, b.positions, attend, pools, tp_axis,
                                linears=cfg.linears, live_rows=b.num_rows)
    logits = model.logits(x[b.sample_index], live_rows=b.num_sample)  # f32[R, V]
    return ForwardOutputs(tuple(pool[None] for pool in pools), logits[None])


def _rank_sample(cfg: StepConfig, logits: jax.Array, rows: SampleRows | PackedSample
                 ) -> tuple[jax.Array, jax.Array]:
    """The sampler's body on every device: logits f32[1, R, V], rows [1, R, ...] (as they
    are or packed) -> the sampled rows packed, i32[1, R, 2 + 2K] (``SampledRows.pack``),
    and their tokens padded to R_max, i32[1, R_max] (the next step's ``fed``)."""
    rows = jax.tree.map(lambda a: a[0], unpacked(rows))
    adjust = LogitAdjustments(rows.bitmask, rows.history, rows.num_prompt, rows.presence,
                              rows.frequency, rows.repetition, rows.bias_ids, rows.bias)
    sampled = SampledRows(*sample(
        logits[0], rows.temperature, rows.top_k, rows.top_p, rows.seed, rows.step,
        cfg.num_top_logprobs, adjust, rows.min_p, rows.top_logprobs))
    tokens = jnp.pad(sampled.tokens, (0, cfg.max_sample_rows - sampled.tokens.shape[0]))
    return sampled.pack()[None], tokens[None]


def _cpu_decode(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs):
    """``ragged_paged_attention``'s signature for the decode slice (one query per slot,
    ``cu_q_lens = arange(D + 1)``) by the CPU handler."""
    del cu_q_lens
    return paged_decode(q, k_pages, v_pages, kv_lens, page_indices, num_seqs)


def _cpu_prefill(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs,
                 query_len=None):
    """``ragged_paged_attention``'s signature by the CPU's ragged handler (its tiling hint
    ``query_len`` has nothing to choose)."""
    del query_len
    return paged_prefill(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs)


def _write_stacked(pool: jax.Array, layer: jax.Array, new: jax.Array, slots: jax.Array,
                   view: tuple[int, ...], cpu: bool = False) -> jax.Array:
    """Scatter ``new`` f[T, H, d] into ``pool`` f[L, pages, ps, Hkv, d] at ``layer``.

    ``slots`` i32[T] index the flattened ``view`` of one layer (the decode view or the
    prefill view); negative slots never write. Scattering into the stacked pool (rather
    than into a sliced-out layer written back afterwards) keeps the update in place: the
    slice-and-write-back form made XLA touch the whole pool every layer. ``cpu``: by the
    CPU's handler (``paged_kv_write``, one copy per row) instead of XLA's scatter.
    """
    if cpu:
        return paged_kv_write(pool, layer, new.astype(pool.dtype), slots)
    num_slots = view[0] * view[1]
    flat = pool.reshape(pool.shape[0], num_slots, *view[2:])
    slots = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)
    if slots.shape[0] == 1:
        # XLA turns a one-index scatter into a dynamic-update-slice that it does not do in
        # place here: it copied the whole pool every layer (0.9 s steps). A second,
        # dropped index keeps it a scatter.
        slots = jnp.concatenate([slots, jnp.full((1,), num_slots, slots.dtype)])
        new = jnp.concatenate([new, new])
    flat = flat.at[layer, slots].set(new.astype(pool.dtype), mode="drop")
    return flat.reshape(pool.shape)


def _layers_as_pages(pool: jax.Array, view: tuple[int, ...]) -> jax.Array:
    """f[L, pages, ...] -> f[L*pages, *view[1:]]: every layer's pages in one free reshape."""
    return pool.reshape(pool.shape[0] * view[0], *view[1:])


def _transfer(prefill_pages: jax.Array, pool: jax.Array, layer: jax.Array, base: jax.Array,
              b: RankInputs, meta: SharedInputs) -> jax.Array:
    """Move completed prefills' head-sharded KV into full-head pages on their decode rank.

    prefill_pages f[L*pages, ps*N, Hkv/N, d] (all layers, prefill view; this layer's pages
    start at ``base``); pool f[L, pages, ps, Hkv, d] (2*Hkv heads: a combined pool). Each
    moved page group is N prefill-view pages (one per rank, one head shard each) = N decode
    pages.
    """
    _, _, ps, hkv, hd = pool.shape
    n, x = meta.transfer_count.shape[0], b.transfer_src.shape[0]
    src = prefill_pages[b.transfer_src + base]  # [X, ps*N, Hkv/N, d]: this rank's shard
    recv = _send_to_decode_ranks(src, meta.transfer_start, meta.transfer_count)
    # [N(head shard), X, ps*N, Hkv/N, d] -> [X, ps*N, Hkv, d] -> N decode pages per group
    full = jnp.moveaxis(recv.reshape(n, x, *src.shape[1:]), 0, 2).reshape(x * n, ps, hkv, hd)
    return pool.at[layer, b.transfer_dst].set(full, mode="drop")


def _load_cached(pool: jax.Array, layer: jax.Array, base: jax.Array, b: RankInputs,
                 meta: SharedInputs, view: tuple[int, ...], cpu: bool) -> jax.Array:
    """Copy cached prefixes' KV from their owners' decode pages into prefill pages.

    pool f[L, pages, ps, Hkv, d]; ``view`` the prefill view of one layer. Every rank sends
    head shard q of each cached page it owns (the first ``meta.load_count[me]`` of
    ``b.load_src``) to rank q: every rank needs a slice of every page. A received page
    lands in one ``ps``-token sub-page of a prefill page (``b.load_dst``; -1 drops padding).
    """
    _, _, ps, hkv, hd = pool.shape
    n = view[1] // ps
    src = _layers_as_pages(pool, pool.shape[1:])[b.load_src + base]  # [Y, ps, Hkv, d]
    y = src.shape[0]
    shards = jnp.moveaxis(src.reshape(y, ps, n, hkv // n, hd), 2, 0)  # [N, Y, ps, Hkv/N, d]
    recv = _send_shards(shards.reshape(n * y, ps, hkv // n, hd), meta.load_count)
    slots = jnp.where(b.load_dst[:, None] >= 0,
                      b.load_dst[:, None] * ps + jnp.arange(ps, dtype=jnp.int32), -1)
    return _write_stacked(pool, layer, recv.reshape(n * y * ps, hkv // n, hd),
                          slots.reshape(-1), view, cpu)


def _materialized(rows: jax.Array) -> jax.Array:
    """``rows`` gathered from the pool, kept a buffer of their own before they are scattered
    back into it. Fused into the scatter, the gather would read the pool the scatter writes,
    and XLA would have to copy the whole pool first to keep the write in place: the likely
    source of the ~100 pool-sized copies a step (~4 ms each) an H200 profile showed once a
    local gather replaced one rank's collective, which had kept them apart."""
    return jax.lax.optimization_barrier(rows)


def _send_shards(shards: jax.Array, count: jax.Array) -> jax.Array:
    """Send block q of ``shards`` f[N*Y, ...] (rows q*Y..) to rank q; ``count`` i32[N] (the
    same on every rank): the live rows of each sender's blocks. Returns f[N*Y, ...]: rows
    ``s*Y + j`` are sender s's j-th row (defined for j < count[s]).

    On GPU and TPU a ragged all-to-all sends only the live rows; XLA:CPU has none, so
    there a dense all-to-all sends every block whole (simulated ranks share host memory).
    One rank sends nothing: no collective is compiled (XLA:GPU ran a ragged all-to-all over
    a single device as a slow kernel of its own, ~0.5 ms a call on an H200).
    """
    n = count.shape[0]
    if n == 1:
        return _materialized(shards)
    y = shards.shape[0] // n
    me = jax.lax.axis_index(SP)

    def ragged(shards: jax.Array, count: jax.Array) -> jax.Array:
        return jax.lax.ragged_all_to_all(
            shards, jnp.zeros_like(shards), jnp.arange(n, dtype=jnp.int32) * y,
            jnp.full((n,), count[me], jnp.int32), jnp.full((n,), me * y, jnp.int32),
            count.astype(jnp.int32), axis_name=SP)

    def dense(shards: jax.Array, count: jax.Array) -> jax.Array:
        del count
        return jax.lax.all_to_all(shards, SP, 0, 0, tiled=True)

    return jax.lax.platform_dependent(shards, count, cpu=dense, default=ragged)


def _send_to_decode_ranks(src: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
    """Send each rank's groups ``src[start[d]:start[d]+count[d]]`` (f[X, ...]) to rank d only.

    start, count i32[N] (the same on every rank). Returns f[N*X, ...] on every rank: row
    ``r*X + j`` is source rank r's j-th group bound here; rows past ``count[me]`` are 0.
    On GPU and TPU a ragged all-to-all moves exactly the live groups. XLA:CPU has no
    ragged all-to-all, so there a dense all-to-all of per-destination padded blocks gives
    the same result (simulated ranks share host memory: no link to save). One rank keeps
    its blocks: a local gather, no collective (see ``_send_shards``).
    """
    n, x = start.shape[0], src.shape[0]

    def blocks(src: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
        """f[N*X, ...]: destination d's groups in rows d*X.., zero past count[d]."""
        j = jnp.arange(x, dtype=jnp.int32)
        live = j[None, :] < count[:, None]  # [N(dest), X]
        rows = jnp.where(live, start[:, None] + j[None, :], 0)
        out = jnp.where(live.reshape(n, x, *[1] * (src.ndim - 1)), src[rows], 0)
        return out.reshape(n * x, *src.shape[1:])

    if n == 1:
        return _materialized(blocks(src, start, count))
    me = jax.lax.axis_index(SP)

    def ragged(src: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
        out = jnp.zeros((n * x, *src.shape[1:]), src.dtype)
        return jax.lax.ragged_all_to_all(
            src, out, start, count, jnp.full((n,), me * x, jnp.int32),
            jnp.full((n,), count[me], jnp.int32), axis_name=SP)

    def dense(src: jax.Array, start: jax.Array, count: jax.Array) -> jax.Array:
        return jax.lax.all_to_all(blocks(src, start, count), SP, 0, 0, tiled=True)

    return jax.lax.platform_dependent(src, start, count, cpu=dense, default=ragged)


@dataclasses.dataclass(frozen=True)
class Step:
    """The step's two jitted functions (see the module docstring)."""

    # (params, kv_pools, RankInputs, SharedInputs, fed i32[N, R_max]) -> ForwardOutputs
    forward: Any
    # (logits f32[N, R, V], SampleRows) -> (i32[N, R, 2 + 2K]: SampledRows packed,
    # i32[N, R_max]: the tokens, padded)
    sample: Any
    max_sample_rows: int  # R_max

    def __call__(self, params: Params, kv_pools: tuple[jax.Array, ...],
                 batch: StepBatch) -> tuple[ForwardOutputs, SampledRows]:
        """Both, one after the other, the sampled rows read back (benchmarks and tests;
        the executor overlaps them). No row is fed on the device."""
        n = batch.rank.tokens.shape[0]
        fed = jnp.zeros((n, self.max_sample_rows), jnp.int32)
        out = self.forward(params, kv_pools, batch.rank, batch.shared, fed)
        sampled, _ = self.sample(out.logits, batch.sample)
        return out, SampledRows.from_packed(np.asarray(jax.device_get(sampled)))


def build_step(cfg: StepConfig, mesh: jax.sharding.Mesh, params_spec: Params) -> Step:
    """The jitted forward (KV pools donated) and sampler. Their batch arguments may be
    packed (:class:`~conflux_jax.executor.batch.Packed`) or not: the specs are prefixes."""
    rows = P(SP)
    pools = (KV_POOL_SPEC,) * num_kv_pools(cfg)
    forward = jax.shard_map(
        functools.partial(_rank_forward, cfg), mesh=mesh,
        in_specs=(params_spec, pools, P(SP), P(), rows),
        out_specs=ForwardOutputs(pools, rows), check_vma=False)
    sampler = jax.shard_map(
        functools.partial(_rank_sample, cfg), mesh=mesh, in_specs=(rows, P(SP)),
        out_specs=(rows, rows), check_vma=False)
    if cfg.replicate_samples:
        # Multi-process: process 0 holds only its own ranks' shards; one small
        # all-gather lets it read every rank's tokens.
        everywhere = jax.sharding.NamedSharding(mesh, P())
        sampler_sharded = sampler

        def sampler(logits: jax.Array, rows: SampleRows) -> tuple[jax.Array, jax.Array]:
            sampled, tokens = sampler_sharded(logits, rows)
            return jax.lax.with_sharding_constraint(sampled, everywhere), tokens

    return Step(jax.jit(forward, donate_argnums=(1,)), jax.jit(sampler),
                cfg.max_sample_rows)
