"""The CPU's decode attention: a C++ handler reading paged KV in place (XLA FFI)."""

from pallas_kernels.cpu_attention.paged_decode import paged_decode, paged_decode_available

__all__ = ["paged_decode", "paged_decode_available"]
