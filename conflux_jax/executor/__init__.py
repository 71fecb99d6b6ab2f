"""The real executor: runs ``IterationPlan``s on a device mesh (typed batch layout, the
``shard_map`` Conflux step, fixed-shape buckets, AOT warm-up, compile cache and guard).

It reads nothing but the plan. Import :mod:`conflux_jax.executor.jax_executor` for
:class:`JaxExecutor`; this package's ``__init__`` stays free of JAX so that importing a
light submodule (``buckets``, ``mesh``) does not start a backend.
"""
