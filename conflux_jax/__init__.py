"""conflux_jax: a JAX-native LLM serving engine with Conflux Parallelism."""
