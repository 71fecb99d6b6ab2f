"""Pallas kernels for conflux_jax, each with its pure-``jnp`` reference and a dispatcher.

``impl=None`` picks the compiled Pallas kernel on GPU and the ``jnp`` reference elsewhere;
``$CONFLUX_ATTENTION_IMPL`` (reference | pallas | interpret) overrides that choice.
"""

from pallas_kernels._common import IMPL_ENV_VAR, IMPLS, resolve_impl
from pallas_kernels.kv_write import write_kv, write_kv_reference
from pallas_kernels.ragged_paged_attention import (
    BlockSizes,
    default_block_sizes,
    ragged_paged_attention,
    ragged_paged_attention_reference,
)

__all__ = [
    "IMPLS",
    "IMPL_ENV_VAR",
    "BlockSizes",
    "default_block_sizes",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_impl",
    "write_kv",
    "write_kv_reference",
]
