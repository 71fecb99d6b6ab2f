"""Paged attention on the CPU as XLA FFI calls: each sequence's KV read in place.

XLA's own form of ragged paged attention (``impl="xla"``) gathers every sequence's pages into
a new buffer and runs small batched dots (decode) or tiled loops (prefill) over it; at
SmolLM2's shapes that costs several times what reading the KV once does. Two C++ handlers
(``paged_attention.cc``) walk each sequence's pages where they lie instead:

- ``paged_decode``: one query token per sequence, one token row (all KV heads) at a time;
- ``paged_prefill``: ragged chunks of query tokens, causal, as blocks of query rows (the
  tokens of a run times the query heads of one KV head) against blocks of keys with an
  online softmax;
- ``paged_kv_write``: a step's new K or V rows into their slots of one layer of the
  stacked pool, in place (one copy per row, where XLA's scatter walks index by index);
- ``paged_copy_pages``: pages of one layer copied onto others, in place (one rank's KV
  transfers and prefix-cache loads).

The library is built on first use with the system C++ compiler into the kernel cache of
``pallas_kernels.cpu_gemm`` (for each of AVX-512, AVX2 and plain x86-64; the loader picks
the host's). fp32 only (``paged_kv_write``: any dtype).

The contract is ``ragged_paged_attention``'s (``paged_decode``: for
``cu_q_lens = arange(S + 1)``); ``ref_ragged_paged_attention`` is the oracle the tests check
both against.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_gemm.stacked_gemm import (
    MATH_HEADER,
    PARALLEL_HEADER,
    load_handlers,
    loads,
)

__all__ = ["paged_attention_available", "paged_copy_pages", "paged_decode", "paged_kv_write",
           "paged_prefill"]

DECODE_TARGET = "conflux_paged_decode"
PREFILL_TARGET = "conflux_paged_prefill"
KV_WRITE_TARGET = "conflux_paged_kv_write"
COPY_PAGES_TARGET = "conflux_paged_copy_pages"
_SOURCE = Path(__file__).with_name("paged_attention.cc")

# No -ffast-math: GCC 12 then links crtfastmath, whose constructor flushes subnormals to
# zero for the whole process the moment the library loads. -fno-trapping-math lets GCC
# vectorize the softmax's exp (its float-to-int step); without it every exp was scalar.
_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-fno-trapping-math", "-pthread")


@functools.cache
def _load() -> ctypes.CDLL:
    return load_handlers(_SOURCE, {"ConfluxPagedDecode": DECODE_TARGET,
                                   "ConfluxPagedPrefill": PREFILL_TARGET,
                                   "ConfluxPagedKvWrite": KV_WRITE_TARGET,
                                   "ConfluxPagedCopyPages": COPY_PAGES_TARGET},
                         _FLAGS, headers=(PARALLEL_HEADER, MATH_HEADER))


@functools.cache
def paged_attention_available() -> tuple[bool, str]:
    """(whether ``paged_decode`` and ``paged_prefill`` can run in this process, why not):
    a CPU backend and a C++ compiler that builds the handlers."""
    if jax.default_backend() != "cpu":
        return False, f"the default backend is {jax.default_backend()}, not cpu"
    return loads(_load)


def paged_decode(
    q: jax.Array,  # f32[S, Hq, d] one query token per sequence
    k_pages: jax.Array,  # f32[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f32[P, page_size, Hkv, d]
    kv_lens: jax.Array,  # i32[S] keys each query sees (its own included)
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    num_seqs: jax.Array,  # i32[] or i32[1] live sequences (rows past it are zero)
    sm_scale: float | None = None,
) -> jax.Array:  # f32[S, Hq, d]
    """Decode attention by the C++ handler (``paged_attention_available`` must hold).
    Page ids are clipped into the pool; only a sequence's first ``kv_lens`` keys are read.
    ``sm_scale`` defaults to the kernel's ``1/sqrt(d)``."""
    return _call(DECODE_TARGET, "paged_decode", q, k_pages, v_pages, kv_lens, page_indices,
                 None, num_seqs, sm_scale)


def paged_prefill(
    q: jax.Array,  # f32[T, Hq, d] query tokens of all sequences, packed
    k_pages: jax.Array,  # f32[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f32[P, page_size, Hkv, d]
    kv_lens: jax.Array,  # i32[S] keys of each sequence, this chunk's included
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    cu_q_lens: jax.Array,  # i32[S+1] sequence s owns q[cu_q_lens[s]:cu_q_lens[s+1]]
    num_seqs: jax.Array,  # i32[] or i32[1] live sequences
    sm_scale: float | None = None,
) -> jax.Array:  # f32[T, Hq, d]; rows outside live sequences are zero
    """Ragged causal attention by the C++ handler (``paged_attention_available`` must
    hold): ``ragged_paged_attention``'s contract, any query length. Page ids are clipped
    into the pool; ``sm_scale`` defaults to ``1/sqrt(d)``."""
    return _call(PREFILL_TARGET, "paged_prefill", q, k_pages, v_pages, kv_lens, page_indices,
                 cu_q_lens, num_seqs, sm_scale)


def paged_kv_write(
    pool: jax.Array,  # [L, ...] each layer's elements: S slots of one row each
    layer: jax.Array | int,  # i32[] the layer written
    rows: jax.Array,  # [T, ...] in the pool's dtype
    slots: jax.Array,  # i32[T] each row's slot in the layer; outside [0, S): not written
) -> jax.Array:  # the pool with the rows written
    """``pool.reshape(L, S, *rows.shape[1:]).at[layer, slots].set(rows, mode="drop")``
    (negative slots dropped too) by the C++ handler (``paged_attention_available`` must
    hold), updating ``pool`` in place: its buffer is aliased to the result, so donate it
    (or carry it through a loop) and XLA copies nothing. The pool is passed in its own
    shape: reshaped on the way in, XLA copied it around the call. Two rows must not share
    a slot."""
    row = math.prod(rows.shape[1:])
    if rows.dtype != pool.dtype or pool.ndim < 2 or rows.ndim < 1 or \
            math.prod(pool.shape[1:]) % max(row, 1):
        raise ValueError(f"paged_kv_write: rows {rows.dtype}{list(rows.shape)} do not fit "
                         f"the pool {pool.dtype}{list(pool.shape)} ([L, ...], each layer "
                         "whole rows)")
    if slots.shape != rows.shape[:1]:
        raise ValueError(f"paged_kv_write: {slots.shape} slots for {rows.shape[0]} rows")
    _load()
    call = jax.ffi.ffi_call(KV_WRITE_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0})
    return call(pool, jnp.asarray(layer, jnp.int32).reshape(1), rows,
                jnp.asarray(slots, jnp.int32))


def paged_copy_pages(
    pool: jax.Array,  # [L, P, ...]
    layer: jax.Array | int,  # i32[] the layer copied within
    src: jax.Array,  # i32[X] source page ids
    start: jax.Array | int,  # i32[] the first entry of src used
    dst: jax.Array,  # i32[Y] destination page ids
    count: jax.Array | int,  # i32[] pages copied: src[start + j] -> dst[j], j < count
) -> jax.Array:  # the pool with the pages copied
    """Pages of one layer of ``pool`` copied onto others by the C++ handler
    (``paged_attention_available`` must hold), in place as ``paged_kv_write``. A page id
    outside ``[0, P)`` copies nothing (padding); ``count`` is clipped to the entries
    given. Destinations must be distinct and not among the sources."""
    if pool.ndim < 2:
        raise ValueError(f"paged_copy_pages: the pool must be [L, P, ...], got {pool.shape}")
    _load()
    call = jax.ffi.ffi_call(COPY_PAGES_TARGET, jax.ShapeDtypeStruct(pool.shape, pool.dtype),
                            input_output_aliases={0: 0})

    def scalar(a: jax.Array | int) -> jax.Array:
        return jnp.asarray(a, jnp.int32).reshape(1)

    return call(pool, scalar(layer), jnp.asarray(src, jnp.int32), scalar(start),
                jnp.asarray(dst, jnp.int32), scalar(count))


def _call(target: str, name: str, q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
          kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array | None,
          num_seqs: jax.Array, sm_scale: float | None) -> jax.Array:
    for arg, a in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if a.dtype != jnp.float32:
            raise ValueError(f"{name} is fp32 only, got {arg} {a.dtype}")
    _load()
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    cu = () if cu_q_lens is None else (jnp.asarray(cu_q_lens, jnp.int32),)
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32),
                jnp.asarray(page_indices, jnp.int32), *cu,
                jnp.asarray(num_seqs, jnp.int32).reshape(1), sm_scale=np.float32(scale))
