"""Paged decode attention on the CPU as an XLA FFI call: each sequence's KV read in place.

For decode-like calls (one query token per sequence) XLA's own form (``impl="xla"``) gathers
every sequence's pages into a new buffer and runs small batched dots over it; at SmolLM2's
shapes that costs several times what reading the KV once does. ``paged_decode`` hands the
pool to a C++ handler (``paged_decode.cc``) that walks each sequence's pages where they
lie, one token row (all KV heads) at a time. It is built on first use with the system C++
compiler into the kernel cache of ``pallas_kernels.cpu_gemm`` (for each of AVX-512, AVX2
and plain x86-64; the loader picks the host's). fp32 only.

The contract is ``ragged_paged_attention``'s for ``cu_q_lens = arange(S + 1)``;
``ragged_paged_attention_ref`` is the oracle the tests check it against.
"""

from __future__ import annotations

import ctypes
import functools
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_gemm import load_handler

__all__ = ["paged_decode", "paged_decode_available"]

TARGET = "conflux_paged_decode"
_SOURCE = Path(__file__).with_name("paged_decode.cc")

# No -ffast-math: GCC 12 then links crtfastmath, whose constructor flushes subnormals to
# zero for the whole process the moment the library loads.
_FLAGS = ("-O3", "-fopenmp-simd", "-fno-math-errno", "-pthread")


@functools.cache
def _load() -> ctypes.CDLL:
    return load_handler(_SOURCE, "ConfluxPagedDecode", TARGET, [jax.ffi.include_dir()],
                        _FLAGS)


@functools.cache
def paged_decode_available() -> tuple[bool, str]:
    """(whether ``paged_decode`` can run in this process, why not): a CPU backend and a
    C++ compiler that builds the handler."""
    if jax.default_backend() != "cpu":
        return False, f"the default backend is {jax.default_backend()}, not cpu"
    try:
        _load()
    except RuntimeError as e:
        return False, str(e)
    return True, ""


def paged_decode(
    q: jax.Array,  # f32[S, Hq, d] one query token per sequence
    k_pages: jax.Array,  # f32[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f32[P, page_size, Hkv, d]
    kv_lens: jax.Array,  # i32[S] keys each query sees (its own included)
    page_indices: jax.Array,  # i32[S, pages_per_seq]
    num_seqs: jax.Array,  # i32[] or i32[1] live sequences (rows past it are zero)
    sm_scale: float | None = None,
) -> jax.Array:  # f32[S, Hq, d]
    """Decode attention by the C++ handler (``paged_decode_available`` must hold).
    Page ids are clipped into the pool; only a sequence's first ``kv_lens`` keys are read.
    ``sm_scale`` defaults to the kernel's ``1/sqrt(d)``."""
    for name, a in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
        if a.dtype != jnp.float32:
            raise ValueError(f"paged_decode is fp32 only, got {name} {a.dtype}")
    _load()
    scale = 1.0 / math.sqrt(q.shape[-1]) if sm_scale is None else sm_scale
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(q, k_pages, v_pages, jnp.asarray(kv_lens, jnp.int32),
                jnp.asarray(page_indices, jnp.int32),
                jnp.asarray(num_seqs, jnp.int32).reshape(1), sm_scale=np.float32(scale))
