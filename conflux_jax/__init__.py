"""conflux_jax: a JAX-native LLM serving engine with Conflux Parallelism.

The public API (``LLM``, ``SamplingParams``, ``StructuredOutputsParams``,
``RequestOutput``, ``CompletionOutput``)
resolves on first use, so importing a low layer (``conflux_jax.plan``, the latency model,
the simulator) neither loads the whole engine nor closes an import cycle through it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from conflux_jax.llm import LLM
    from conflux_jax.outputs import CompletionOutput, RequestOutput
    from conflux_jax.sampling import GuidedDecodingParams, SamplingParams, StructuredOutputsParams

_EXPORTS = {"LLM": "conflux_jax.llm", "SamplingParams": "conflux_jax.sampling",
            "RequestOutput": "conflux_jax.outputs", "CompletionOutput": "conflux_jax.outputs",
            "StructuredOutputsParams": "conflux_jax.sampling",
            "GuidedDecodingParams": "conflux_jax.sampling"}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput",
           "StructuredOutputsParams", "GuidedDecodingParams"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'conflux_jax' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
