"""The CPU's dense GEMM on packed weights: ``x @ w[layer]`` as an XLA FFI call.

A CPU decode step multiplies 1-64 token rows by every weight matrix: bound by how fast the
weights stream in from memory, where XLA:CPU's dot reached ~15-22 GB/s of a host's ~40
(bench/RESULTS.md, "Dense layers through our own packed-weight GEMM"). The weights are
held packed: ``w f32[..., K, N]`` becomes ``f32[..., P, K, 32]``, P = ceil(N / 32) panels of
32 output columns, each one contiguous stream (columns past N are zero). The C++ handler
(``packed_gemm.cc``) reads a panel front to back with prefetches far ahead and keeps each
block of it in L1 for all the rows (taken in L2-sized row blocks once x outgrows L2);
panels are split over the CPU handlers' spinning workers (``pallas_kernels/cpu_parallel.cc``).
It serves every row count: at 256 rows it runs at 55-85% of the cores' FMA peak (by host
and hour), as fast as XLA's dot.

The handler is built on first use with the system C++ compiler into the kernel cache
(``kernel_cache_dir``), with a kernel for AVX-512, AVX2 and plain vectors, picked per host
when called (AVX2 has two register tiles: whole-panel rows up to 16 rows, taller
half-panel tiles above). ``packed_matmul_xla`` is the same contract in ``jnp`` (the tests' second
oracle beside numpy, and the route on other platforms).

Beside the plain product, a transformer block's other per-row work is done as tiles are
stored, so that XLA runs no pass of its own over the activations in the layer loop: the
gated form (SwiGLU), the residual form (the residual add, in place), and
``packed_qkv`` (Q, K and V into three buffers, Q and K rotated: ``Rope``); the gated and QKV
forms take the block's ``RmsNorm`` of x too.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import math
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_gemm.stacked_gemm import (
    MATH_HEADER,
    PARALLEL_HEADER,
    load_handlers,
    loads,
)

__all__ = ["PANEL", "RmsNorm", "Rope", "pack_gated", "pack_weight", "packed_gemm_available",
           "packed_matmul", "packed_matmul_xla", "packed_qkv", "unpack_weight"]

PANEL = 32  # output columns of a panel (the kernel's kPanel)
TARGET = "conflux_packed_gemm"
GATED_TARGET = "conflux_packed_gemm_gated"
RESIDUAL_TARGET = "conflux_packed_gemm_residual"
QKV_TARGET = "conflux_packed_gemm_qkv"
_SOURCE = Path(__file__).with_name("packed_gemm.cc")
# -std=c++17 turns FMA contraction off; the kernel's multiply-adds are written to be fused.
# The gated store's exp vectorizes only without errno and traps (see cpu_attention).
_FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp-simd", "-fno-math-errno",
          "-fno-trapping-math", "-pthread")


@functools.cache
def _load() -> ctypes.CDLL:
    return load_handlers(_SOURCE, {"ConfluxPackedGemm": TARGET,
                                   "ConfluxPackedGemmGated": GATED_TARGET,
                                   "ConfluxPackedGemmResidual": RESIDUAL_TARGET,
                                   "ConfluxPackedGemmQkv": QKV_TARGET},
                         _FLAGS, headers=(PARALLEL_HEADER, MATH_HEADER))


@functools.cache
def packed_gemm_available() -> tuple[bool, str]:
    """(whether ``packed_matmul`` can run in this process, why not): a CPU backend and a
    C++ compiler that builds the handler."""
    if jax.default_backend() != "cpu":
        return False, f"the default backend is {jax.default_backend()}, not cpu"
    return loads(_load)


def pack_weight(w: Any) -> np.ndarray:
    """f[..., K, N] -> f[..., P, K, 32]: 32-column panels, zero past N (numpy, so that
    loaders' host arrays are packed before they reach the device)."""
    w = np.asarray(w)
    *lead, k, n = w.shape
    panels = -(-n // PANEL)
    padded = np.zeros((*lead, k, panels * PANEL), w.dtype)
    padded[..., :n] = w
    return np.ascontiguousarray(
        np.moveaxis(padded.reshape(*lead, k, panels, PANEL), -2, -3))


def pack_gated(w_gate: Any, w_up: Any) -> np.ndarray:
    """f[..., K, N] twice -> f[..., 2P, K, 32]: the gate's and up's panels interleaved
    (gate panel p at 2p, up's at 2p + 1), what ``packed_matmul(..., gated=True)`` reads."""
    if np.shape(w_gate) != np.shape(w_up):
        raise ValueError(f"gate and up must have one shape, got {np.shape(w_gate)} and "
                         f"{np.shape(w_up)}")
    gate, up = pack_weight(w_gate), pack_weight(w_up)
    *lead, panels, k, panel = gate.shape
    return np.stack([gate, up], axis=-3).reshape(*lead, 2 * panels, k, panel)


def unpack_weight(wp: Any, n: int) -> Any:
    """The inverse of ``pack_weight`` (``jnp`` or numpy, as given): f[..., K, n]."""
    xp = jnp if isinstance(wp, jax.Array) else np
    *lead, panels, k, panel = wp.shape
    return xp.moveaxis(wp, -3, -2).reshape(*lead, k, panels * panel)[..., :n]


def _check(x: jax.Array, wp: jax.Array, n: int, gated: bool) -> None:
    if wp.ndim not in (3, 4) or wp.shape[-1] != PANEL:
        raise ValueError(f"w must be packed f32[(L,) P, K, {PANEL}], got shape {wp.shape}")
    if x.shape[-1] != wp.shape[-2]:
        raise ValueError(f"x's last axis is {x.shape[-1]}, w contracts {wp.shape[-2]}")
    per_panel = 2 if gated else 1  # a gated product reads a gate and an up panel each
    if -(-n // PANEL) * per_panel != wp.shape[-3]:
        raise ValueError(f"n={n} columns do not fill {wp.shape[-3]} panels of {PANEL}"
                         + (" (gated: gate and up, interleaved)" if gated else ""))


@dataclasses.dataclass(frozen=True)
class Rope:
    """Rotary tables by row (rotate-half form, ``models.rope.apply_rope``'s): a head of
    ``2 * half`` columns has its halves a, b replaced by a cos - b sin, b cos + a sin."""

    cos: jax.Array  # f32[..., half] (x's leading axes): cos(position * inv_freq)
    sin: jax.Array  # f32[..., half]

    def apply(self, y: jax.Array) -> jax.Array:  # f32[..., H * 2 half], rotated
        """The rotation in plain ``jnp`` (the handler's oracle)."""
        half = self.cos.shape[-1]
        heads = y.reshape(*y.shape[:-1], -1, 2 * half)
        a, b = heads[..., :half], heads[..., half:]
        c, s = self.cos[..., None, :], self.sin[..., None, :]
        return jnp.concatenate([a * c - b * s, b * c + a * s], axis=-1).reshape(y.shape)


@dataclasses.dataclass(frozen=True)
class RmsNorm:
    """An RMSNorm the GEMM applies to x's rows before the product (``x * rsqrt(mean(x^2) +
    eps) * weight`` in fp32, ``models.decoder.rms_norm``'s)."""

    weight: jax.Array  # f32[L, K] stacked (the GEMM's ``layer`` picks the row) or f32[K]
    eps: float

    def operand(self, wp: jax.Array, k: int) -> jax.Array:  # f32[L, K]
        """The weight as the handler takes it: one row per layer of ``wp``."""
        layers = wp.shape[0] if wp.ndim == 4 else 1
        weight = self.weight.reshape(1, k) if self.weight.ndim == 1 else self.weight
        if weight.shape != (layers, k) or weight.dtype != jnp.float32:
            raise ValueError(f"norm: the weight must be f32[{layers}, {k}] (or f32[{k}] for "
                             f"one matrix), got {weight.dtype}{list(weight.shape)}")
        return weight


def _norm_args(norm: RmsNorm | None, wp: jax.Array, k: int) -> tuple[jax.Array, float]:
    """(the norm operand, eps): f32[0] and 0 for no norm."""
    if norm is None:
        return jnp.zeros((0,), jnp.float32), 0.0
    return norm.operand(wp, k), float(norm.eps)


def _operands(op: str, x: jax.Array, wp: jax.Array, n: int, gated: bool,
              layer: jax.Array | int, rows: jax.Array | int | None
              ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Every handler's first four operands, checked, with the handler loaded: x f32[M, K]
    (leading axes flattened), w f32[L, P, K, 32] (one matrix as L = 1), layer i32[1] and
    the live rows i32[1] (all M when ``rows`` is None)."""
    if x.dtype != jnp.float32 or wp.dtype != jnp.float32:
        raise ValueError(f"{op} is fp32 only, got {x.dtype} @ {wp.dtype}")
    _check(x, wp, n, gated)
    _load()
    m = math.prod(x.shape[:-1])
    live = jnp.asarray(m if rows is None else rows, jnp.int32).reshape(1)
    return (x.reshape(m, x.shape[-1]), wp[None] if wp.ndim == 3 else wp,
            jnp.asarray(layer, jnp.int32).reshape(1), live)


def packed_matmul(
    x: jax.Array,  # f32[..., K]
    wp: jax.Array,  # f32[L, P, K, 32] stacked layers, or f32[P, K, 32] one matrix
    layer: jax.Array | int,  # i32[] which of the L matrices (0 for one matrix)
    n: int,  # output columns (P = ceil(n / 32); 2P panels when gated)
    rows: jax.Array | int | None = None,  # i32[] live rows of x flattened; None: all
    gated: bool = False,  # wp from pack_gated: silu(x @ gate) * (x @ up)
    residual: jax.Array | None = None,  # f32[..., n]: residual + x @ w, in its buffer
    norm: RmsNorm | None = None,  # gated only: x's rows RMS-normed first
) -> jax.Array:  # f32[..., n]
    """``x @ w[layer]`` on packed ``w`` by the C++ handler, reading the layer in place
    (``packed_gemm_available`` must hold). With ``rows``, only the first ``rows`` rows of
    ``x`` (its leading axes flattened) are multiplied and the others come out zero: a step
    padded to its bucket spends no FLOPs on its padding. ``gated``: a SwiGLU MLP's
    ``silu(x @ gate) * (x @ up)`` in one call, on ``pack_gated``'s interleaved panels.
    ``residual``: ``residual + x @ w``, summed into the residual's buffer (aliased to the
    result, so no pass of its own over it); the rows past ``rows`` are the residual's.
    ``norm`` (gated only): the product of ``norm``'s RMSNorm of x's rows, normed inside the
    call (a block's MLP norm without a pass of XLA's own)."""
    if norm is not None and not gated:
        raise ValueError("packed_matmul: norm is for the gated product (and packed_qkv)")
    args = _operands("packed_matmul", x, wp, n, gated, layer, rows)
    wp, m, lead = args[1], args[0].shape[0], x.shape[:-1]
    if residual is not None:
        if gated:
            raise ValueError("packed_matmul: a gated product takes no residual")
        if residual.shape != (*lead, n) or residual.dtype != jnp.float32:
            raise ValueError(f"packed_matmul: the residual must be f32{[*lead, n]}, got "
                             f"{residual.dtype}{list(residual.shape)}")
    result = jax.ShapeDtypeStruct((m, n), jnp.float32)
    if residual is not None:
        call = jax.ffi.ffi_call(RESIDUAL_TARGET, result, input_output_aliases={4: 0})
        out = call(*args, residual.reshape(m, n))
    elif gated:
        weight, eps = _norm_args(norm, wp, x.shape[-1])
        out = jax.ffi.ffi_call(GATED_TARGET, result)(*args, weight, eps=np.float32(eps))
    else:
        out = jax.ffi.ffi_call(TARGET, result)(*args)
    return out.reshape(*lead, n)


def packed_qkv(
    x: jax.Array,  # f32[..., K]
    wp: jax.Array,  # f32[L, P, K, 32] or f32[P, K, 32]: Q, K and V's columns side by side
    layer: jax.Array | int,  # i32[]
    widths: tuple[int, int, int],  # Q's, K's and V's columns, each a multiple of 32
    rows: jax.Array | int | None = None,  # i32[] live rows of x flattened; None: all
    rope: Rope | None = None,  # Q and K rotated by row (their heads: 2 * half columns)
    norm: RmsNorm | None = None,  # x's rows RMS-normed first
) -> tuple[jax.Array, jax.Array, jax.Array]:  # f32[..., widths[i]] each
    """A fused QKV projection (``x @ w[layer]``, as :func:`packed_matmul`) returned as its
    three parts, each tile stored straight into its own buffer, Q and K rotated as they are
    stored when ``rope`` is given, of x's rows RMS-normed inside the call when ``norm`` is:
    no slicing of one output afterwards, no RoPE pass and no norm pass."""
    args = _operands("packed_qkv", x, wp, sum(widths), False, layer, rows)
    if len(widths) != 3 or any(w <= 0 or w % PANEL for w in widths):
        raise ValueError(f"packed_qkv: widths {widths} must be three multiples of {PANEL}")
    lead, m = x.shape[:-1], args[0].shape[0]
    if rope is not None:
        half = rope.cos.shape[-1]
        if rope.cos.shape != (*lead, half) or rope.sin.shape != rope.cos.shape:
            raise ValueError(f"rope: cos and sin must be f32{[*lead, 'half']}, got "
                             f"{list(rope.cos.shape)} and {list(rope.sin.shape)}")
        if half % PANEL or widths[0] % (2 * half) or widths[1] % (2 * half):
            raise ValueError(f"rope: half a head ({half}) must be whole panels of {PANEL} "
                             f"and Q, K ({widths[:2]}) whole heads")
        cos, sin = rope.cos.reshape(m, half), rope.sin.reshape(m, half)
    else:
        cos = sin = jnp.zeros((m, 0), jnp.float32)
    weight, eps = _norm_args(norm, args[1], x.shape[-1])
    results = tuple(jax.ShapeDtypeStruct((m, w), jnp.float32) for w in widths)
    q, k, v = jax.ffi.ffi_call(QKV_TARGET, results)(*args, cos, sin, weight,
                                                    eps=np.float32(eps))
    return tuple(p.reshape(*lead, w) for p, w in zip((q, k, v), widths, strict=True))


def packed_matmul_xla(x: jax.Array, wp: jax.Array, layer: jax.Array | int,
                      n: int, gated: bool = False) -> jax.Array:
    """The same product in plain ``jnp`` with fp32 sums: the panels unpacked, then a dot
    (gated: two dots, then ``jax.nn.silu(gate) * up``)."""
    _check(x, wp, n, gated)
    if wp.ndim == 4:
        wp = jax.lax.dynamic_index_in_dim(wp, jnp.asarray(layer, jnp.int32), keepdims=False)
    if gated:
        gate, up = (packed_matmul_xla(x, wp[i::2], 0, n) for i in (0, 1))
        return jax.nn.silu(gate) * up
    return jnp.matmul(x, unpack_weight(wp, n), preferred_element_type=jnp.float32)
