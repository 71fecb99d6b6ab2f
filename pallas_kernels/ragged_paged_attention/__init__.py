"""Ragged paged attention (prefill chunks, decode and mixed batches in one op) as a package:

* ``api``: ``ragged_paged_attention``, the entry point: argument checks and impl dispatch,
* ``schedule``: the query-block schedule both fast paths share,
* ``xla``: the tiled pure-``jnp`` path (``impl="xla"``, the fast path on CPU),
* ``pallas``: the Pallas kernel (``impl="pallas"`` on GPU, ``impl="interpret"`` anywhere),
* ``combined``: the op over one combined K/V pool (JAX's TPU kernel's layout, ``impl="tpu"``),
* ``reference``: ``ref_ragged_paged_attention``, the dense float64 oracle of the tests,
* ``validation``: the shape, dtype and metadata checks.

The op's contract is in ``api``'s docstring.
"""

from pallas_kernels.ragged_paged_attention.api import ragged_paged_attention
from pallas_kernels.ragged_paged_attention.combined import (
    combine_kv,
    ragged_paged_attention_combined,
    split_kv,
)
from pallas_kernels.ragged_paged_attention.pallas import BlockSizes, default_block_sizes
from pallas_kernels.ragged_paged_attention.reference import ref_ragged_paged_attention
from pallas_kernels.ragged_paged_attention.xla import (
    XlaTiling,
    default_xla_tiling,
    ragged_paged_attention_xla,
)

__all__ = [
    "BlockSizes",
    "XlaTiling",
    "combine_kv",
    "default_block_sizes",
    "default_xla_tiling",
    "ragged_paged_attention",
    "ragged_paged_attention_combined",
    "ragged_paged_attention_xla",
    "ref_ragged_paged_attention",
    "split_kv",
]
