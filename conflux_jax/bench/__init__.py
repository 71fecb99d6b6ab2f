"""Benchmarks: ``python -m conflux_jax.bench <subcommand> [--json PATH] ...``."""
