"""Rotary position embeddings (HF "rotate half" convention), with Llama 3 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from conflux_jax.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> np.ndarray:
    """f32[d/2]: RoPE inverse frequencies, Llama-3-scaled when the config asks for it.

    Computed in float32 in the same order as transformers so logits agree to ~1e-5.
    """
    d = config.head_dim
    exponents = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    inv_freq = (np.float32(1.0) / (np.float32(config.rope_theta) ** exponents)).astype(np.float32)
    rs = config.rope_scaling
    if rs is None:
        return inv_freq
    old_ctx = rs.original_max_position_embeddings
    low_freq_wavelen = old_ctx / rs.low_freq_factor
    high_freq_wavelen = old_ctx / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (old_ctx / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    blended = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, blended, scaled).astype(np.float32)


def rope_angles(
    positions: jax.Array,  # i32[...]
    inv_freq: jax.Array,  # f32[d/2]
) -> jax.Array:  # f32[..., d/2]: each position's angle per frequency
    return positions.astype(jnp.float32)[..., None] * inv_freq


def apply_rope(
    x: jax.Array,  # f[..., H, d]
    positions: jax.Array,  # i32[...]
    inv_freq: jax.Array,  # f32[d/2]
) -> jax.Array:  # f[..., H, d], same dtype as x
    freqs = rope_angles(positions, inv_freq)  # f32[..., d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # f32[..., 1, d]
    cos, sin = jnp.cos(emb).astype(x.dtype), jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin
