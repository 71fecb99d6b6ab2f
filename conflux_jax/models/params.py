"""The parameter layout every loader produces and the decoder consumes.

A nested dict of arrays; matrices are stored ``[in, out]`` so the forward is ``x @ w``
(HF and GGUF store ``[out, in]``: loaders transpose). Per-layer weights are stacked on a
leading ``[L]`` axis so the decoder runs its layers with ``lax.scan``::

    embed        f[V, D]
    final_norm   f[D]
    lm_head      f[D, V]          absent when the embeddings are tied
    layers:
      attn_norm  f[L, D]
      wq         f[L, D, Hq*d]
      wk         f[L, D, Hkv*d]
      wv         f[L, D, Hkv*d]
      wo         f[L, Hq*d, D]
      q_norm     f[L, d]          Qwen3 only (config.qk_norm)
      k_norm     f[L, d]          Qwen3 only
      mlp_norm   f[L, D]
      w_gate     f[L, D, F]
      w_up       f[L, D, F]
      w_down     f[L, F, D]

The executor may hold ``layers`` unstacked instead (:func:`unstack_layers`): a tuple of L
dicts with the same names and no leading axis (``wq`` f[D, Hq*d]). The decoder then runs
its layers unrolled, each reading its own arrays: inside a scan XLA copies every layer's
weights out of the stacked arrays before each matmul.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from conflux_jax.config import ModelConfig

Params = dict[str, Any]  # nested dict of arrays, layout above


class CheckpointError(ValueError):
    """A checkpoint is missing, corrupt, unsupported or does not match its config."""


def param_shapes(config: ModelConfig) -> dict[str, Any]:
    """The expected shape of every parameter, as a nested dict of tuples."""
    c = config
    L, D, F, d = c.num_layers, c.hidden_size, c.intermediate_size, c.head_dim
    layers: dict[str, tuple[int, ...]] = {
        "attn_norm": (L, D),
        "wq": (L, D, c.num_heads * d),
        "wk": (L, D, c.num_kv_heads * d),
        "wv": (L, D, c.num_kv_heads * d),
        "wo": (L, c.num_heads * d, D),
        "mlp_norm": (L, D),
        "w_gate": (L, D, F),
        "w_up": (L, D, F),
        "w_down": (L, F, D),
    }
    if c.qk_norm:
        layers["q_norm"] = (L, d)
        layers["k_norm"] = (L, d)
    shapes: dict[str, Any] = {"embed": (c.vocab_size, D), "final_norm": (D,), "layers": layers}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = (D, c.vocab_size)
    return shapes


def validate_params(config: ModelConfig, params: Mapping[str, Any], source: str) -> None:
    """Raise ``CheckpointError`` naming ``source`` if ``params`` does not match ``config``."""
    expected = param_shapes(config)
    problems: list[str] = []

    def walk(exp: Mapping[str, Any], got: Mapping[str, Any], prefix: str) -> None:
        for key, shape in exp.items():
            name = f"{prefix}{key}"
            if key not in got:
                problems.append(f"missing weight {name}")
            elif isinstance(shape, dict):
                if not isinstance(got[key], Mapping):
                    problems.append(f"{name} should be a group of weights")
                else:
                    walk(shape, got[key], f"{name}.")
            elif tuple(got[key].shape) != shape:
                problems.append(
                    f"{name} has shape {tuple(got[key].shape)}, config expects {shape}")
        for key in got:
            if key not in exp:
                problems.append(f"unexpected weight {prefix}{key}")

    walk(expected, params, "")
    if problems:
        shown = "; ".join(problems[:6]) + ("; ..." if len(problems) > 6 else "")
        raise CheckpointError(f"{source}: weights do not match the config: {shown}")


def unstack_layers(params: Params) -> Params:
    """``params`` with ``layers`` as a tuple of per-layer dicts, each array ``[i]`` of the
    stacked one (a view for numpy arrays: nothing is copied until it is placed)."""
    stacked = params["layers"]
    if not isinstance(stacked, Mapping):
        raise ValueError("the layer weights are already unstacked")
    num_layers = len(next(iter(stacked.values())))
    return {**params, "layers": tuple({name: w[i] for name, w in stacked.items()}
                                      for i in range(num_layers))}


def layers_unstacked(params: Mapping[str, Any]) -> bool:
    return not isinstance(params["layers"], Mapping)


# Packed, wq | wk | wv are one matrix, their columns side by side: one GEMM call streams a
# layer's Q, K and V projections. In a scan over SmolLM2's 30 layers that ran 1.62x faster
# at one row, 1.08x at 16, 1.02x at 256 (fewer calls; wk and wv alone are too narrow to keep
# the prefetcher and both threads busy). gate | up side by side gained nothing (0.96-1.04x,
# bench/RESULTS.md, "A second host of this kind"); they are packed as one gated matrix
# instead (``GATED_LINEARS``: panels interleaved, ``pack_gated``), whose GEMM applies the
# SwiGLU on each tile: XLA's pass of silu(gate) * up over the whole [T, 2F] product is gone.
FUSED_LINEARS = {"wqkv": ("wq", "wk", "wv")}
GATED_LINEARS = {"w_gate_up": ("w_gate", "w_up")}
PACKED_LINEARS = ("wqkv", "wo", "w_down")


def fused_widths(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each fused matrix's parts' output columns, in order (``FUSED_LINEARS``)."""
    layers = param_shapes(config)["layers"]
    return {name: tuple(layers[part][-1] for part in parts)
            for name, parts in FUSED_LINEARS.items()}


def pack_linears(params: Params) -> Params:
    """``params`` with every matrix the packed GEMM reads packed into 32-column panels
    (``pallas_kernels.cpu_gemm.pack_weight``): the layer matrices, Q, K and V fused first
    (``FUSED_LINEARS``: ``wqkv`` f[L, P, D, 32]), gate and up as one gated matrix
    (``GATED_LINEARS``: ``w_gate_up`` f[L, 2P, D, 32], ``pack_gated``), and the LM head,
    f[ceil(V/32), D, 32]. Tied embeddings are stored once, as that packed head
    (``Decoder.embed_tokens`` reads token rows out of it). Host (numpy) arrays."""
    from pallas_kernels.cpu_gemm import pack_gated, pack_weight

    if linears_packed(params):
        raise ValueError("the linears are already packed")

    def pack_layer(weights: Mapping[str, Any]) -> dict[str, Any]:
        fused = {name: pack_weight(np.concatenate([np.asarray(weights[p]) for p in parts],
                                                  axis=-1))
                 for name, parts in FUSED_LINEARS.items()}
        gated = {name: pack_gated(*(weights[p] for p in parts))
                 for name, parts in GATED_LINEARS.items()}
        parts = {p for ps in (*FUSED_LINEARS.values(), *GATED_LINEARS.values()) for p in ps}
        kept = {k: pack_weight(w) if k in PACKED_LINEARS else w
                for k, w in weights.items() if k not in parts}
        return {**kept, **fused, **gated}

    layers = params["layers"]
    out = {**params, "layers": tuple(pack_layer(w) for w in layers)
           if layers_unstacked(params) else pack_layer(layers)}
    if "lm_head" in params:
        out["lm_head"] = pack_weight(params["lm_head"])
    else:
        out["embed"] = pack_weight(np.asarray(params["embed"]).T)
    return out


def linears_packed(params: Mapping[str, Any]) -> bool:
    """Whether ``params`` holds its linears packed (``pack_linears``)."""
    layers = params["layers"]
    return "wqkv" in (layers[0] if not isinstance(layers, Mapping) else layers)
