"""Host-side scheduling: latency model, waterfill, placement, admission, policies, router."""

from conflux_jax.scheduler.admission import moore_hodgson
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.latency import (
    Affine,
    BatchShape,
    LatencyModel,
    ProfileSample,
    coeffs_path,
    fit,
    mape,
)
from conflux_jax.scheduler.placement import place_decode
from conflux_jax.scheduler.request import Request, RequestState
from conflux_jax.scheduler.roofline import kv_tokens_per_rank, roofline_model
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.scheduler.waterfill import Dispatcher, waterfill_assign

__all__ = [
    "Affine", "BatchShape", "Dispatcher", "LatencyModel", "ProfileSample", "Request",
    "RequestState", "Scheduler", "SchedulerConfig", "coeffs_path", "fit",
    "kv_tokens_per_rank", "mape", "moore_hodgson", "place_decode", "roofline_model",
    "waterfill_assign",
]
