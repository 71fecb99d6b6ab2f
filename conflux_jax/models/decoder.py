"""The Flax NNX decoder shared by Llama 3.x, SmolLM2 and Qwen3.

Layer weights are stacked on a leading ``[L]`` axis and run with ``lax.scan`` so compile
time stays flat in depth; given the per-layer weights too (``with_layer_list``) the layers
can also be unrolled, which on XLA:CPU spares a copy of every layer's weights per step.
Attention is a callback: the dense reference, the paged Conflux
step and the baselines all reuse the same layer math and differ only in how they attend
and where they keep KV. Every method works on a flat token axis ``[..., D]`` and derives
head counts from the weight shapes, so the same code runs on tensor-parallel shards
inside ``shard_map`` (pass ``tp_axis`` to all-reduce the row-parallel outputs).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from conflux_jax.config import ModelConfig
from conflux_jax.models.params import Params, param_shapes, validate_params
from conflux_jax.models.rope import apply_rope, inverse_frequencies

KV = TypeVar("KV")  # whatever KV state an attention backend carries through the layers

# attend(layer, q f[..., Hq, d], k f[..., Hkv, d], v f[..., Hkv, d], kv) -> (o f[..., Hq, d], kv)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]

LAYER_WEIGHTS = ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm",
                 "mlp_norm", "w_gate", "w_up", "w_down")


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
    """All transformer blocks, each weight stacked over layers: ``wq`` is f[L, D, Hq*d]."""

    def __init__(self, weights: Mapping[str, jax.Array]):
        for name in LAYER_WEIGHTS:
            setattr(self, name, nnx.Param(weights[name]) if name in weights else None)

    def stacked(self) -> dict[str, jax.Array]:
        return {n: getattr(self, n)[...] for n in LAYER_WEIGHTS if getattr(self, n) is not None}


class Decoder(nnx.Module):
    """A decoder-only transformer; ``nnx.state(model).to_pure_dict()`` is the params layout."""

    def __init__(self, config: ModelConfig, params: Params):
        self.config = config
        self.embed = nnx.Param(params["embed"])
        self.final_norm = nnx.Param(params["final_norm"])
        self.lm_head = nnx.Param(params["lm_head"]) if "lm_head" in params else None
        self.layers = DecoderLayers(params["layers"])
        # Per-layer weights (plain arrays, not Params: they only run, never saved).
        layer_list = params.get("layer_list")
        self.layer_list = nnx.data(None if layer_list is None else tuple(map(dict, layer_list)))
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
        """tokens i32[...] -> f[..., D]."""
        return jnp.take(self.embed[...], tokens, axis=0)

    def run_layers(
        self,
        x: jax.Array,  # f[..., D] token activations
        positions: jax.Array,  # i32[...] absolute position of each token
        attend: AttendFn,
        kv: KV,
        tp_axis: str | None = None,
        unroll: bool = False,
    ) -> tuple[jax.Array, KV]:
        """All transformer blocks; ``kv`` is carried so pools update in place.

        By default the layers run under ``lax.scan``. ``unroll`` (the params need
        ``layer_list``) runs them as straight-line code: inside a
        loop XLA:CPU copies each layer's weights out of the stacked arrays before every
        matmul (a dynamic slice it does not fuse into the dot), ~40% of a 16-row decode
        step of SmolLM2; unrolled over separate arrays there is nothing to copy, at ~5x
        the compile time.
        """
        cfg = self.config
        inv_freq = self.inv_freq[...]
        head_dim = cfg.head_dim

        def block(carry, layer_in):
            h, kv = carry
            w, layer = layer_in
            a = rms_norm(h, w["attn_norm"], cfg.rms_norm_eps)
            q = linear(a, w["wq"]).reshape(*a.shape[:-1], -1, head_dim)
            k = linear(a, w["wk"]).reshape(*a.shape[:-1], -1, head_dim)
            v = linear(a, w["wv"]).reshape(*a.shape[:-1], -1, head_dim)
            if cfg.qk_norm:
                q = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
                k = rms_norm(k, w["k_norm"], cfg.rms_norm_eps)
            q = apply_rope(q, positions, inv_freq)
            k = apply_rope(k, positions, inv_freq)
            o, kv = attend(layer, q, k, v, kv)
            attn_out = linear(o.reshape(*o.shape[:-2], -1), w["wo"])
            h = h + _all_reduce(attn_out, tp_axis)
            m = rms_norm(h, w["mlp_norm"], cfg.rms_norm_eps)
            ffn = linear(jax.nn.silu(linear(m, w["w_gate"])) * linear(m, w["w_up"]), w["w_down"])
            h = h + _all_reduce(ffn, tp_axis)
            return (h, kv), None

        if unroll:
            if self.layer_list is None:
                raise ValueError("unroll needs per-layer weights (models.params.with_layer_list)")
            for i, w in enumerate(self.layer_list):
                (x, kv), _ = block((x, kv), (w, jnp.int32(i)))
            return x, kv
        weights = self.layers.stacked()
        layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
        (x, kv), _ = jax.lax.scan(block, (x, kv), (weights, layer_ids))
        return x, kv

    def logits(self, x: jax.Array, tp_axis: str | None = None) -> jax.Array:
        """x f[..., D] -> f32[..., V]: final norm and LM head (tied head = embedding^T)."""
        h = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps)
        head = self.lm_head[...] if self.lm_head is not None else self.embed[...].T
        return jnp.matmul(h, head, preferred_element_type=jnp.float32)


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
