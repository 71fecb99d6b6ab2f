"""Executors: the plan/executor contract, the KV block manager and the simulator."""

from conflux_jax.executor.base import (
    PLAN_MODES,
    DecodeSlot,
    Executor,
    IterationPlan,
    KVSpec,
    PrefillPiece,
    StepResult,
)
from conflux_jax.executor.block_manager import (
    BlockManager,
    BlockManagerError,
    OutOfPagesError,
    PageTable,
)

__all__ = [
    "PLAN_MODES", "BlockManager", "BlockManagerError", "DecodeSlot", "Executor",
    "IterationPlan", "KVSpec", "OutOfPagesError", "PageTable", "PrefillPiece", "StepResult",
]
