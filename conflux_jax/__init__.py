"""conflux_jax: a JAX-native LLM serving engine with Conflux Parallelism."""

from conflux_jax.llm import LLM
from conflux_jax.outputs import CompletionOutput, RequestOutput
from conflux_jax.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
