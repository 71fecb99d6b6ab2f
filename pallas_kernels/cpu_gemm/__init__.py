"""The CPU's dense GEMMs as XLA FFI calls reading stacked weights in place: our own kernel on
packed weights (``packed_gemm``), and OpenBLAS on plain ones (``stacked_gemm``)."""

from pallas_kernels.cpu_gemm.packed_gemm import (
    PANEL,
    RmsNorm,
    Rope,
    pack_gated,
    pack_weight,
    packed_gemm_available,
    packed_matmul,
    packed_matmul_xla,
    packed_qkv,
    unpack_weight,
)
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

__all__ = ["CACHE_ENV_VAR", "PANEL", "RmsNorm", "Rope", "blas_available", "build_handler",
           "handler_key", "kernel_cache_dir", "library_key", "load_handler", "load_library",
           "loads", "pack_gated", "pack_weight", "packed_gemm_available", "packed_matmul",
           "packed_matmul_xla", "packed_qkv", "stacked_matmul", "stacked_matmul_xla",
           "unpack_weight"]
