"""Recover Llama 3 RoPE scaling parameters from a GGUF ``rope_freqs`` tensor.

llama.cpp's converter does not write Llama 3.1+ ``rope_scaling`` as metadata: it bakes
it into a ``rope_freqs`` tensor f[d/2] of per-frequency divisors (1 for short
wavelengths, ``factor`` for long ones, a smooth blend in between). Our ``RopeScaling``
is the parametric form, so we fit it back. The RoPE math only depends on the two
boundary wavelengths (``orig / low_freq_factor`` and ``orig / high_freq_factor``), so any
``original_max_position_embeddings`` works; we use the metadata's when present. The fit
is verified by recomputing the tensor, so a file that is not llama3-shaped is rejected.
"""

from __future__ import annotations

import math

import numpy as np

from conflux_jax.config import RopeScaling

_REL_TOL = 1e-5


def llama3_rope_factors(theta: float, rope_dim: int, rs: RopeScaling) -> np.ndarray:
    """The divisors llama.cpp stores for ``rs``: f64[rope_dim // 2]."""
    inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    smooth = ((rs.original_max_position_embeddings / wavelen - rs.low_freq_factor)
              / (rs.high_freq_factor - rs.low_freq_factor))
    mid = 1.0 / ((1 - smooth) / rs.factor + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, rs.factor, mid))


def _nice(x: float) -> float:
    """Round away float noise from the fit (3.9999998 -> 4.0); exact values stay exact."""
    x = float(x)
    r = float(f"{x:.6g}")
    return r if abs(r - x) <= 1e-6 * abs(x) else x


def recover_llama3_scaling(factors: np.ndarray, theta: float, rope_dim: int,
                           original_context: int = 8192) -> RopeScaling | None:
    """Fit ``RopeScaling`` to f[rope_dim // 2] ``factors``; ``None`` if they are all 1.

    Raises ``ValueError`` when no llama3 scaling reproduces ``factors``.
    """
    f = np.asarray(factors, dtype=np.float64).reshape(-1)
    if f.shape[0] != rope_dim // 2:
        raise ValueError(f"rope_freqs has {f.shape[0]} entries, expected {rope_dim // 2}")
    factor = float(f.max())
    if np.allclose(f, 1.0, rtol=_REL_TOL, atol=0):
        return None
    inv_freq = theta ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)
    u = inv_freq / (2 * math.pi)  # 1 / wavelength, decreasing along the array
    hi = np.isclose(f, 1.0, rtol=_REL_TOL, atol=0)
    lo = np.isclose(f, factor, rtol=_REL_TOL, atol=0)
    mid = ~hi & ~lo
    # In the blend region 1/f = 1/factor + s * (1 - 1/factor) with s linear in u:
    # s = 0 at the low-frequency boundary u_low, s = 1 at the high-frequency one u_high.
    s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(u[mid], s[mid], 1)
        u_low, u_high = -intercept / slope, (1.0 - intercept) / slope
    else:
        # Too few blend points to fit: any boundaries inside the gaps between the regions
        # reproduce the table; take the middle of the admissible range.
        u_hi_min = u[hi].min() if hi.any() else 2 * u.max()  # u_high must be <= this
        u_lo_max = u[lo].max() if lo.any() else 0.0  # u_low must be >= this
        if mid.sum() == 1:
            um, sm = u[mid][0], s[mid][0]
            # s(um) = sm ties the boundaries: u_low = (um - sm * u_high) / (1 - sm), and
            # u_low >= u_lo_max bounds u_high from above.
            upper = min(u_hi_min, (um - u_lo_max * (1.0 - sm)) / sm)
            u_high = 0.5 * (um + upper)
            u_low = (um - sm * u_high) / (1.0 - sm)
        else:  # no blend point: both boundaries sit in the one gap, low below high
            u_low = u_lo_max + (u_hi_min - u_lo_max) / 3
            u_high = u_lo_max + 2 * (u_hi_min - u_lo_max) / 3
    if not 0 < u_low < u_high:
        raise ValueError("rope_freqs is not a llama3 frequency scaling")
    orig = int(original_context)
    rs = RopeScaling(factor=_nice(factor), low_freq_factor=_nice(orig * u_low),
                     high_freq_factor=_nice(orig * u_high),
                     original_max_position_embeddings=orig)
    if not np.allclose(llama3_rope_factors(theta, rope_dim, rs), f, rtol=1e-4, atol=0):
        raise ValueError("rope_freqs is not a llama3 frequency scaling")
    return rs
