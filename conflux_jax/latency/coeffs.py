"""Shipped and profiled latency-model coefficients, one JSON per (model, hardware, mesh)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from conflux_jax.latency.model import LatencyModel

COEFFS_DIR = Path(__file__).parent / "coeffs"


def coeffs_path(model: str, hardware: str, sp: int, tp: int = 1) -> Path:
    """Conventional JSON location for fitted coefficients of (model, hardware, mesh)."""
    return COEFFS_DIR / f"{model}__{hardware}__sp{sp}_tp{tp}.json"


def profile_name(model: str) -> str:
    """The name a checkpoint's fitted coefficients go by (``coeffs_path``'s ``model``)."""
    return "smollm2-135m" if model == "default" else Path(str(model)).stem


def load_fitted(model: str, hardware: str, sp: int, tp: int,
                token_buckets: Sequence[int]) -> LatencyModel | None:
    """The shipped (or profiled) fit for this (model, hardware, mesh), if there is one,
    priced for an executor with ``token_buckets`` (the per-token coefficients carry over;
    only the padding changes)."""
    path = coeffs_path(profile_name(model), hardware, sp, tp)
    if not path.is_file():
        return None
    return LatencyModel.load(path).for_buckets(token_buckets)
