"""The CPU's paged attention: C++ handlers reading KV pages in place (XLA FFI)."""

from pallas_kernels.cpu_attention.paged_attention import (
    paged_attention_available,
    paged_copy_pages,
    paged_decode,
    paged_kv_write,
    paged_prefill,
)

__all__ = ["paged_attention_available", "paged_copy_pages", "paged_decode", "paged_kv_write",
           "paged_prefill"]
