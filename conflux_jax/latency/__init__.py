"""The iteration latency model (Eqs. 2-6): evaluation, fitting, roofline, shipped fits.

Shared by the scheduler (which plans with it) and the simulator (whose clock it is).
"""

from conflux_jax.latency.coeffs import coeffs_path, load_fitted, profile_name
from conflux_jax.latency.fit import ProfileSample, fit, mape
from conflux_jax.latency.model import Affine, BatchShape, LatencyModel, attention_work
from conflux_jax.latency.roofline import kv_tokens_per_rank, roofline_model

__all__ = [
    "Affine", "BatchShape", "LatencyModel", "ProfileSample", "attention_work", "coeffs_path",
    "fit", "kv_tokens_per_rank", "load_fitted", "mape", "profile_name", "roofline_model",
]
