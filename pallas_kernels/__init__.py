"""Pallas kernels for conflux_jax, each with its ``jnp`` (XLA) path, its dense reference and a
dispatcher.

``impl=None`` picks the compiled Pallas kernel on GPU and the ``jnp`` XLA path elsewhere;
``$CONFLUX_ATTENTION_IMPL`` (xla | pallas | interpret) overrides that choice. The ``ref_*``
functions are the plain numpy oracles the tests check every implementation against.
"""

from pallas_kernels._common import IMPL_ENV_VAR, IMPLS, resolve_impl
from pallas_kernels.kv_write import ref_write_kv, write_kv, write_kv_xla
from pallas_kernels.ragged_paged_attention import (
    BlockSizes,
    XlaTiling,
    default_block_sizes,
    default_xla_tiling,
    ragged_paged_attention,
    ragged_paged_attention_xla,
    ref_ragged_paged_attention,
)

__all__ = [
    "IMPLS",
    "IMPL_ENV_VAR",
    "BlockSizes",
    "XlaTiling",
    "default_block_sizes",
    "default_xla_tiling",
    "ragged_paged_attention",
    "ragged_paged_attention_xla",
    "ref_ragged_paged_attention",
    "ref_write_kv",
    "resolve_impl",
    "write_kv",
    "write_kv_xla",
]
