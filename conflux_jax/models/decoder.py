"""The Flax NNX decoder shared by Llama 3.x, SmolLM2 and Qwen3.

Layer weights are stacked on a leading ``[L]`` axis and run with ``lax.scan`` so compile
time stays flat in depth, or held per layer (``models.params.unstack_layers``) and run
unrolled, so that no matmul reads a copy of its weights.
Attention is a callback: the dense reference, the paged Conflux
step and the baselines all reuse the same layer math and differ only in how they attend
and where they keep KV. Every method works on a flat token axis ``[..., D]`` and derives
head counts from the weight shapes, so the same code runs on tensor-parallel shards
inside ``shard_map`` (pass ``tp_axis`` to all-reduce the row-parallel outputs).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conflux_jax.config import ModelConfig
from conflux_jax.models.params import (
    FUSED_LINEARS,
    GATED_LINEARS,
    Params,
    fused_widths,
    layers_unstacked,
    param_shapes,
    validate_params,
)
from conflux_jax.models.rope import apply_rope, inverse_frequencies, rope_angles
from pallas_kernels.cpu_gemm import PANEL, RmsNorm, Rope, packed_matmul, packed_qkv, stacked_matmul

KV = TypeVar("KV")  # whatever KV state an attention backend carries through the layers

# attend(layer, q f[..., Hq, d], k f[..., Hkv, d], v f[..., Hkv, d], kv) -> (o f[..., Hq, d], kv)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

# How the linears run: XLA's dot; OpenBLAS in place (CPU); our GEMM on weights packed in
# 32-column panels (CPU, ``models.params.pack_linears``; the LM head too).
LINEARS = ("xla", "blas", "packed")
# Token rows for which "blas" calls OpenBLAS; XLA's dot takes the rest. SmolLM2's 30 dense
# layers in a scan on a 2-core AVX2 host (bench/linears_rows.py): through OpenBLAS 1.3x
# faster at 2 rows, 1.6-1.8x at 3-32, 1.4x at 64, 1.1x at 128; slower at one row (XLA's
# matrix-vector loop reads the stacked weights in place), even at 256 (a prefill chunk,
# where XLA's dot amortizes its copy). Measured before OpenBLAS's workers were set to sleep
# at once (pallas_kernels.cpu_gemm); the range is due a re-measure.
BLAS_MIN_ROWS, BLAS_MAX_ROWS = 2, 128

LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm",
                 "mlp_norm", "w_gate", "w_up", "w_down", *FUSED_LINEARS, *GATED_LINEARS)


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """x f[..., n] @ w f[n, m] -> f[..., m] in x's dtype, accumulated in float32: bf16
    activations keep fp32 sums (what cuBLAS and the MXU do natively; stated so that no
    backend sums in bf16)."""
    return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x f[..., n], weight f[n]: RMSNorm computed in float32, as transformers does."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


class DecoderLayers(nnx.Module):
    """Transformer block weights: all blocks stacked over layers (``wq`` f[L, D, Hq*d]), or
    one block's (``wq`` f[D, Hq*d])."""

    def __init__(self, weights: Mapping[str, jax.Array]):
        for name in LAYER_WEIGHTS:
            setattr(self, name, nnx.Param(weights[name]) if name in weights else None)

    def weights(self) -> dict[str, jax.Array]:
        return {n: getattr(self, n)[...] for n in LAYER_WEIGHTS if getattr(self, n) is not None}


class Decoder(nnx.Module):
    """A decoder-only transformer; ``nnx.state(model).to_pure_dict()`` is the params layout."""

    def __init__(self, config: ModelConfig, params: Params):
        self.config = config
        self.embed = nnx.Param(params["embed"])
        self.final_norm = nnx.Param(params["final_norm"])
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None
        self.layers: DecoderLayers | nnx.List = (
            nnx.List([DecoderLayers(w) for w in params["layers"]])
            if layers_unstacked(params) else DecoderLayers(params["layers"]))
        self.inv_freq = nnx.Variable(jnp.asarray(inverse_frequencies(config)))

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_params(cls, config: ModelConfig, params: Params, dtype: Any = jnp.float32,
                    source: str = "params") -> Decoder:
        validate_params(config, params, source)
        return cls(config, jax.tree.map(lambda a: jnp.asarray(a, dtype), params))

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, dtype: Any = jnp.float32,
               scale: float = 0.02) -> Decoder:
        """Random weights (norm weights near 1) for tests and benchmarks."""
        return cls(config, random_params(config, seed, dtype, scale))

    def params(self) -> Params:
        """The weights as a plain nested dict (layout of ``models.params``)."""
        state = nnx.state(self, nnx.Param).to_pure_dict()
        return {k: v for k, v in state.items() if v is not None}

    # ----------------------------------------------------------------- forward pieces
    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """tokens i32[...] -> f[..., D]. Tied embeddings held packed as the LM head
        (f[ceil(V/32), D, 32]) are read from there: token t is column t % 32 of panel t // 32."""
        embed = self.embed[...]
        if embed.ndim == 3:  # tied and packed (an untied model's embed stays plain)
            return embed[tokens // PANEL, :, tokens % PANEL]
        return jnp.take(embed, tokens, axis=0)

    def run_layers(
        self,
        x: jax.Array,  # f[..., D] token activations
        positions: jax.Array,  # i32[...] absolute position of each token
        attend: AttendFn,
        kv: KV,
        tp_axis: str | None = None,
        linears: str = "xla",
        live_rows: jax.Array | None = None,  # i32[] x's first rows that are not padding
    ) -> tuple[jax.Array, KV]:
        """All transformer blocks; ``kv`` is carried so pools update in place.

        Stacked weights run under ``lax.scan``. Inside the loop XLA:CPU copies each layer's
        weights out of the stacked arrays before every matmul (a dynamic slice it does not
        fold into the dot); a 16-row SmolLM2 decode step ran 1.05-1.07x faster without
        them on a 2-core CPU, an 8B decode step ~6 ms faster on an H200. ``linears="blas"``
        (fp32 on the CPU) runs the linears of ``BLAS_MIN_ROWS..BLAS_MAX_ROWS`` rows as
        OpenBLAS calls that read the layer in place instead (``pallas_kernels.cpu_gemm``);
        ``linears="packed"`` runs every linear on the packed-weight GEMM, which also reads
        the layer in place, on weights ``models.params.pack_linears`` packed, with the
        SwiGLU applied inside the gate/up GEMM and the residual adds summed into the O and
        down GEMMs' outputs; unsharded, also the two RMSNorms inside the QKV and gate/up
        GEMMs, and Q, K and V stored apart by the QKV GEMM, which rotates Q and K itself
        (heads of 64 or 128 with no Q/K norm); given ``live_rows`` it multiplies only x's first
        ``live_rows`` rows (leading axes flattened) and leaves the padding rows after them
        zero (other routes compute every row). Weights held per layer run unrolled,
        ``layer`` a Python int: every matmul reads its own weight array, at the price of a
        program L times longer to compile.
        """
        if linears not in LINEARS:
            raise ValueError(f"linears must be one of {LINEARS}, got {linears!r}")
        packed = self.packed
        if packed != (linears == "packed"):
            raise ValueError(f"linears={linears!r} on weights {'' if packed else 'not '}packed "
                             "(models.params.pack_linears): linears='packed' reads packed ones")
        cfg = self.config
        # Output columns per layer matrix: packed weights pad them to whole panels.
        out_features = {name: shape[-1] for name, shape in param_shapes(cfg)["layers"].items()}
        widths = fused_widths(cfg)  # packed: Q, K and V are one matrix
        out_features.update({name: sum(w) for name, w in widths.items()})
        out_features.update({name: out_features[parts[0]]  # silu(gate) * up: gate's width
                             for name, parts in GATED_LINEARS.items()})

        def split(a: jax.Array, name: str) -> list[jax.Array]:
            bounds = np.cumsum(widths[name])[:-1].tolist()
            return jnp.split(a, bounds, axis=-1)
        inv_freq = self.inv_freq[...]
        head_dim = cfg.head_dim
        # Unsharded, the packed GEMMs apply the block's two RMSNorms to their input rows (no
        # pass of XLA's own), the QKV GEMM stores Q, K and V apart (no slices of one output)
        # where each is whole panels, and rotates Q and K as it stores them (no RoPE pass)
        # where half a head is whole panels and Q and K are not normed first, from tables
        # made once for every layer.
        fuse_norms = packed and tp_axis is None
        qkv_apart = fuse_norms and all(w % PANEL == 0 for w in widths["wqkv"])
        rope = None
        if qkv_apart and not cfg.qk_norm and head_dim % (2 * PANEL) == 0:
            freqs = rope_angles(positions, inv_freq)  # f32[..., d/2]
            rope = Rope(jnp.cos(freqs), jnp.sin(freqs))
        unrolled = isinstance(self.layers, nnx.List)
        if unrolled and linears == "blas":
            raise ValueError("linears='blas' reads stacked layer weights; these are per layer")

        def block(carry, layer, weight: Callable[[str], jax.Array],
                  lin: Callable[[jax.Array, str], jax.Array],
                  qkv: Callable[[jax.Array, Rope | None], tuple[jax.Array, ...]] | None):
            h, kv = carry

            def norm(a: jax.Array, name: str) -> jax.Array:
                return rms_norm(a, weight(name), cfg.rms_norm_eps)

            if qkv_apart:
                q, k, v = qkv(h, rope)  # attn_norm inside
            else:
                a = norm(h, "attn_norm")
                q, k, v = split(lin(a, "wqkv"), "wqkv") if packed else \
                    (lin(a, "wq"), lin(a, "wk"), lin(a, "wv"))
            q, k, v = (p.reshape(*h.shape[:-1], -1, head_dim) for p in (q, k, v))
            if cfg.qk_norm:
                q = norm(q, "q_norm")
                k = norm(k, "k_norm")
            if rope is None:
                q = apply_rope(q, positions, inv_freq)
                k = apply_rope(k, positions, inv_freq)

            def plus_linear(h: jax.Array, a: jax.Array, name: str) -> jax.Array:
                """h + a @ w (all-reduced): the packed GEMM sums into h's buffer itself."""
                if packed and tp_axis is None:
                    return lin(a, name, h)
                return h + _all_reduce(lin(a, name), tp_axis)

            o, kv = attend(layer, q, k, v, kv)
            h = plus_linear(h, o.reshape(*o.shape[:-2], -1), "wo")
            if fuse_norms:
                gated = lin(h, "w_gate_up", None, "mlp_norm")
            else:
                m = norm(h, "mlp_norm")
                gated = lin(m, "w_gate_up") if packed else \
                    jax.nn.silu(lin(m, "w_gate")) * lin(m, "w_up")
            h = plus_linear(h, gated, "w_down")
            return h, kv

        def packed_linear(weights: Mapping[str, jax.Array], layer: jax.Array | int,
                          a: jax.Array, name: str, residual: jax.Array | None = None,
                          norm: str | None = None) -> jax.Array:
            """``a @ weights[name][layer]`` on the packed GEMM, ``a`` normed first by the
            RMSNorm ``weights[norm]`` when given (stacked weights, or one layer's)."""
            rms = None if norm is None else RmsNorm(weights[norm], cfg.rms_norm_eps)
            return packed_matmul(a, weights[name], layer, out_features[name], live_rows,
                                 gated=name in GATED_LINEARS, residual=residual, norm=rms)

        def packed_qkv_of(weights: Mapping[str, jax.Array], layer: jax.Array | int):
            rms = RmsNorm(weights["attn_norm"], cfg.rms_norm_eps)
            return lambda h, rope: packed_qkv(h, weights["wqkv"], layer, widths["wqkv"],
                                              live_rows, rope, rms)

        if unrolled:
            carry = (x, kv)
            for i, layer_weights in enumerate(self.layers):
                weights = layer_weights.weights()  # this layer's own arrays
                carry = block(carry, i, weights.__getitem__,
                              functools.partial(packed_linear, weights, 0) if packed
                              else (lambda a, name, w=weights: linear(a, w[name])),
                              packed_qkv_of(weights, 0) if qkv_apart else None)
            return carry

        blas = linears == "blas"
        stacked = self.layers.weights()

        def scanned(carry, layer):
            # Every weight stays stacked, a loop constant: OpenBLAS reads its layer in place;
            # the rest take theirs by ``[layer]`` (what scanning the weights would slice).
            def lin(a: jax.Array, name: str, residual: jax.Array | None = None,
                    norm: str | None = None) -> jax.Array:
                if packed:
                    return packed_linear(stacked, layer, a, name, residual, norm)
                if blas and BLAS_MIN_ROWS <= math.prod(a.shape[:-1]) <= BLAS_MAX_ROWS:
                    return stacked_matmul(a, stacked[name], layer).astype(a.dtype)
                return linear(a, stacked[name][layer])

            return block(carry, layer, lambda name: stacked[name][layer], lin,
                         packed_qkv_of(stacked, layer) if qkv_apart else None), None

        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, kv), _ = jax.lax.scan(scanned, (x, kv), layer_ids)
        return x, kv

    def logits(self, x: jax.Array, tp_axis: str | None = None,
               live_rows: jax.Array | None = None) -> jax.Array:
        """x f[..., D] -> f32[..., V]: final norm and LM head (tied head = embedding^T).
        XLA's dot even with ``linears="blas"``: the head is not stacked, so there is no copy
        to spare, and OpenBLAS was no faster at 16-64 rows (3x slower at one). A packed
        head (``pack_linears``) runs on the packed GEMM, over x's first ``live_rows``
        rows when given (i32[]; the logits of the rows after them are zero)."""
        h = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
        if self.packed:  # the head f[ceil(V/32), D, 32]
            head = (self.lm_head if self.lm_head is not None else self.embed)[...]
            return packed_matmul(h.astype(jnp.float32), head, 0, self.config.vocab_size,
                                 live_rows)
        head = self.lm_head[...] if self.lm_head is not None else self.embed[...].T
        return jnp.matmul(h, head, preferred_element_type=jnp.float32)

    @property
    def packed(self) -> bool:
        """Whether the weights are packed (``models.params.pack_linears``, which packs the
        LM head with the layer matrices)."""
        return (self.lm_head if self.lm_head is not None else self.embed)[...].ndim == 3


def _all_reduce(x: jax.Array, axis: str | None) -> jax.Array:
    return x if axis is None else jax.lax.psum(x, axis)


def random_params(config: ModelConfig, seed: int = 0, dtype: Any = jnp.float32,
                  scale: float = 0.02) -> Params:
    """Random weights in the params layout (numpy, so tests can feed them anywhere)."""
    rng = np.random.default_rng(seed)

    def make(path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray:
        name = path[-1]
        if "norm" in name:
            arr = 1.0 + 0.1 * rng.standard_normal(shape)
        else:
            arr = scale * rng.standard_normal(shape)
        return arr.astype(np.float32).astype(jnp.dtype(dtype))

    def walk(shapes: Mapping[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
        return {k: walk(v, (*path, k)) if isinstance(v, dict) else make((*path, k), v)
                for k, v in shapes.items()}

    return walk(param_shapes(config), ())
