"""This host's floor for a decode step: what results from different hosts are read against.

Hosts of the same kind differ several-fold (copy bandwidth 18-43 GB/s seen), so every CPU
figure is recorded with the host's own numbers: the CPU model and vector ISA flags, the
large-copy bandwidth, and the sgemm rate on the exact matrix shapes of the model's linears
at the step's row count: per shape the faster of a well-kept BLAS (numpy's OpenBLAS) and
our packed-weight GEMM (``pallas_kernels.cpu_gemm``; 2-5x OpenBLAS at 1-16 rows on an
AVX-512 host, where vLLM-CPU's step beat the OpenBLAS-only floor). The floor of a decode
step of R rows is the larger of every weight read once at copy bandwidth and the step's
FLOPs at that sgemm rate; no engine's step can beat it by much, and issue 19 asks ours to
stay within 2x of it.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import time
from pathlib import Path

import numpy as np

from conflux_jax.config import ModelConfig

ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni",
             "avx512_bf16", "avx_vnni", "amx_bf16", "amx_tile", "asimd", "sve")
# Environment variables that cap the vector ISA a library uses below what the CPU has
# (bench/compare_isa_capped.sh sets them all): a result is read against these too.
ISA_CAP_VARS = ("CONFLUX_GEMM_ISA", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA",
                "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "OPENBLAS_CORETYPE")


@dataclasses.dataclass(frozen=True)
class HostFloor:
    cpu: str
    isa: tuple[str, ...]  # the vector flags of ISA_FLAGS this CPU has
    isa_caps: dict[str, str]  # the ISA caps set for this run (``isa_caps()``)
    copy_gbs: float  # read + write bytes per second of a large copy
    rows: int  # the decode step's rows (one token per request)
    sgemm_gflops: float  # the best sgemm on the step's linear shapes, all together
    weight_bytes: int  # fp32 bytes of every matrix the step reads (linears + LM head)
    flops: int  # 2 * rows * those matrices' elements
    memory_s: float  # weight_bytes read once at copy_gbs (as bench/decode_cpu.py)
    compute_s: float  # flops at sgemm_gflops
    floor_s: float  # max(memory_s, compute_s)

    def as_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def cpu_description() -> tuple[str, tuple[str, ...]]:
    """(model name, ISA flags of ``ISA_FLAGS`` present), from /proc/cpuinfo where there."""
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines()
                 if line.lower().startswith(("model name", "hardware"))), platform.processor())
    flags: set[str] = set()
    for line in text.splitlines():
        if line.lower().startswith(("flags", "features")):
            flags |= set(line.split(":", 1)[1].split())
    return name or "unknown", tuple(f for f in ISA_FLAGS if f in flags)


def isa_caps(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The ISA caps in ``environ`` (default: this process's): each of ``ISA_CAP_VARS`` that
    is set, and XLA's ``--xla_cpu_max_isa`` when ``XLA_FLAGS`` has it."""
    env = os.environ if environ is None else environ
    caps = {k: env[k] for k in ISA_CAP_VARS if env.get(k)}
    xla = [f for f in env.get("XLA_FLAGS", "").split() if f.startswith("--xla_cpu_max_isa")]
    if xla:
        caps["XLA_FLAGS"] = " ".join(xla)
    return caps


def copy_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """Best-of-``repeats`` large memcpy bandwidth (read + write bytes per second)."""
    src = np.ones(megabytes * 2**20 // 4, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def step_matrices(config: ModelConfig) -> list[tuple[int, int, int]]:
    """(count, in, out) of every matrix a decode step multiplies: each layer's Q, K, V, O,
    gate, up and down projections, and the LM head."""
    c, d = config, config.head_dim
    per_layer = [(d * c.num_heads), d * c.num_kv_heads, d * c.num_kv_heads]
    mats = [(c.num_layers, c.hidden_size, n) for n in per_layer]
    mats += [(c.num_layers, d * c.num_heads, c.hidden_size),
             (2 * c.num_layers, c.hidden_size, c.intermediate_size),
             (c.num_layers, c.intermediate_size, c.hidden_size),
             (1, c.hidden_size, c.vocab_size)]
    return mats


def sgemm_seconds(rows: int, k: int, n: int, repeats: int = 5) -> float:
    """Fastest of ``repeats`` fp32 ``[rows, k] @ [k, n]`` in numpy's BLAS."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, k), dtype=np.float32)
    b = rng.standard_normal((k, n), dtype=np.float32)
    out = np.empty((rows, n), np.float32)
    best = float("inf")
    for _ in range(repeats + 1):  # the first one warms the BLAS threads up
        t = time.perf_counter()
        np.matmul(a, b, out=out)
        best = min(best, time.perf_counter() - t)
    return best


def packed_sgemm_seconds(rows: int, k: int, n: int, repeats: int = 5) -> float:
    """Fastest of ``repeats`` fp32 ``[rows, k] @ [k, n]`` by the packed GEMM (inf where it
    cannot run)."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels.cpu_gemm import pack_weight, packed_gemm_available, packed_matmul

    if not packed_gemm_available()[0]:
        return float("inf")
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((rows, k), dtype=np.float32))
    w = jnp.asarray(pack_weight(rng.standard_normal((k, n), dtype=np.float32)))
    fn = jax.jit(lambda a, w: packed_matmul(a, w, 0, n))
    best = float("inf")
    for _ in range(repeats + 1):  # the first one compiles
        t = time.perf_counter()
        fn(a, w).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return best


def host_floor(config: ModelConfig, rows: int, copy_megabytes: int = 512,
               repeats: int = 5) -> HostFloor:
    """Measure this host's floor for a decode step of ``rows`` rows of ``config``."""
    name, isa = cpu_description()
    copy = copy_bandwidth_gbs(copy_megabytes, repeats)
    mats = step_matrices(config)
    weight_bytes = sum(count * k * n * 4 for count, k, n in mats)
    flops = sum(2 * rows * count * k * n for count, k, n in mats)
    compute_s = sum(count * min(sgemm_seconds(rows, k, n, repeats),
                                packed_sgemm_seconds(rows, k, n, repeats))
                    for count, k, n in mats)
    memory_s = weight_bytes / (copy * 1e9)
    return HostFloor(name, isa, isa_caps(), copy, rows, flops / compute_s / 1e9, weight_bytes,
                     flops, memory_s, compute_s, max(memory_s, compute_s))
