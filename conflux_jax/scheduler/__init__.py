"""Host-side scheduling: waterfill dispatch, dual-mode placement, Moore–Hodgson admission,
the router and the KV block manager (which allocates the pages each plan carries)."""

from conflux_jax.scheduler.admission import moore_hodgson
from conflux_jax.scheduler.block_manager import (
    BlockManager,
    BlockManagerError,
    OutOfPagesError,
    PageTable,
)
from conflux_jax.scheduler.config import SchedulerConfig
from conflux_jax.scheduler.placement import place_decode
from conflux_jax.scheduler.request import Request, RequestState
from conflux_jax.scheduler.scheduler import Scheduler
from conflux_jax.scheduler.waterfill import Dispatcher, waterfill_assign

__all__ = [
    "BlockManager", "BlockManagerError", "Dispatcher", "OutOfPagesError", "PageTable",
    "Request", "RequestState", "Scheduler", "SchedulerConfig", "moore_hodgson",
    "place_decode", "waterfill_assign",
]
