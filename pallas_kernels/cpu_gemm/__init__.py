"""The CPU's dense GEMM: OpenBLAS through an XLA FFI call, reading stacked weights in place."""

from pallas_kernels.cpu_gemm.stacked_gemm import (
    CACHE_ENV_VAR,
    blas_available,
    build_handler,
    handler_key,
    kernel_cache_dir,
    library_key,
    load_handler,
    load_library,
    loads,
    stacked_matmul,
    stacked_matmul_xla,
)

__all__ = ["CACHE_ENV_VAR", "blas_available", "build_handler", "handler_key",
           "kernel_cache_dir", "library_key", "load_handler", "load_library", "loads",
           "stacked_matmul", "stacked_matmul_xla"]
