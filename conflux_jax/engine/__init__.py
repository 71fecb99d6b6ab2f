"""The engine: the one driver loop (:mod:`.core`, any executor) and the serving engine on
top of it (:mod:`.engine`: tokenized requests, streamed outputs, the JAX executor).

Names resolve lazily so that the simulator can import :mod:`conflux_jax.engine.core`
without loading JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Engine": "engine", "EngineConfig": "engine", "EngineError": "engine",
    "StepOutput": "engine", "POLICIES": "engine", "default_latency_model": "engine",
    "EngineCore": "core", "Iteration": "core", "StepFailed": "core",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
