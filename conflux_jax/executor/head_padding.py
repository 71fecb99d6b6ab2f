"""Zero-pad attention heads so the mesh divides them (e.g. SmolLM2's 9/3 heads at sp=4).

KV heads are padded to a multiple of ``sp * tp`` and query heads to keep the GQA group
size, so query head ``h`` still reads KV head ``h // group``. A padded query head has zero
``wq`` columns, so its query is 0 (also after q-norm and RoPE), its attention output is
the mean of zero values, and its ``wo`` rows are zero: logits do not change.
"""

from __future__ import annotations

import numpy as np

from conflux_jax.config import ModelConfig
from conflux_jax.models.params import Params


def padded_heads(config: ModelConfig, multiple: int) -> tuple[int, int]:
    """(num_heads, num_kv_heads) after padding KV heads up to a multiple of ``multiple``."""
    kv = -(-config.num_kv_heads // multiple) * multiple
    return kv * config.q_per_kv, kv


def pad_heads(config: ModelConfig, params: Params, multiple: int) -> tuple[ModelConfig, Params]:
    """Return a config and params whose head counts are divisible by ``multiple``."""
    hq, hkv = padded_heads(config, multiple)
    if (hq, hkv) == (config.num_heads, config.num_kv_heads):
        return config, params
    d = config.head_dim
    layers = dict(params["layers"])

    def pad_cols(w: np.ndarray, heads: int) -> np.ndarray:  # [L, D, h*d] -> [L, D, heads*d]
        w = np.asarray(w)
        out = np.zeros((*w.shape[:-1], heads * d), w.dtype)
        out[..., : w.shape[-1]] = w
        return out

    layers["wq"] = pad_cols(layers["wq"], hq)
    layers["wk"] = pad_cols(layers["wk"], hkv)
    layers["wv"] = pad_cols(layers["wv"], hkv)
    wo = np.asarray(layers["wo"])  # [L, Hq*d, D]
    wo_padded = np.zeros((wo.shape[0], hq * d, wo.shape[2]), wo.dtype)
    wo_padded[:, : wo.shape[1]] = wo
    layers["wo"] = wo_padded
    return config.replace(num_heads=hq, num_kv_heads=hkv), {**params, "layers": layers}
