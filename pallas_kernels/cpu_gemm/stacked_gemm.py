"""Stacked-weight GEMM on the CPU: ``x @ w[layer]`` through OpenBLAS, as an XLA FFI call.

Inside the decoder's layer ``scan`` XLA:CPU copies ``w[layer]`` out of the stacked ``[L, ...]``
weights before every dot (a dynamic slice it does not fold into the dot): for SmolLM2 at 16
decode rows that copy was ~35% of the step. A custom call receives the whole stacked buffer
untouched, so ``stacked_matmul`` reads the layer in place and hands it to OpenBLAS's sgemm
(the ``scipy-openblas32`` wheel that NumPy and SciPy's own builds come from).

The C++ handler (``stacked_gemm.cc``) is compiled on first use with the system C++ compiler
(seconds) into ``$CONFLUX_KERNEL_CACHE`` (default ``~/.cache/conflux_jax/kernels``), keyed by
the source and the jaxlib and OpenBLAS versions. ``stacked_matmul_xla`` is the same contract
in plain ``jnp``: the oracle the tests check against, and the path on other platforms.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["CACHE_ENV_VAR", "blas_available", "build_handler", "handler_key", "load_handler",
           "load_handlers", "load_library", "loads", "stacked_matmul", "stacked_matmul_xla"]

CACHE_ENV_VAR = "CONFLUX_KERNEL_CACHE"
# OpenBLAS's idle workers spin ~0.1 s (2^28 cycles) before they sleep; between two GEMMs of
# a step they take the cores from XLA's own threads (attention, the LM head). Sleeping at
# once (2^4 cycles): a 16-row decode step of SmolLM2 in 86 ms instead of 142. Set at import:
# it only took effect when set before JAX's CPU backend started. A user's value wins.
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
TARGET = "conflux_stacked_gemm"
_SOURCE = Path(__file__).with_name("stacked_gemm.cc")
_FLAGS = ("-O2",)
# Work split over threads, shared by the CPU handlers (cpu_gemm, cpu_attention): the header
# they include, and the one library of spinning workers they all call into.
PARALLEL_HEADER = Path(__file__).parent.parent / "cpu_parallel.h"
MATH_HEADER = PARALLEL_HEADER.with_name("cpu_math.h")  # the elementwise math they share
_PARALLEL_SOURCE = PARALLEL_HEADER.with_suffix(".cc")
_PARALLEL_FLAGS = ("-O2", "-pthread")


def kernel_cache_dir() -> Path:
    """Where built handlers (and what is measured with them) are kept."""
    if os.environ.get(CACHE_ENV_VAR):
        return Path(os.environ[CACHE_ENV_VAR])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "conflux_jax" / "kernels"


def build_handler(source: Path, out: Path, include: list[str], lib_dir: str | None = None,
                  lib: str | None = None, flags: tuple[str, ...] = ("-O2",)) -> None:
    """Compile an FFI handler's ``source`` into the shared library ``out`` (atomically:
    concurrent builders each write a temporary file and rename it into place)."""
    cxx = os.environ.get("CXX", "c++")
    out.parent.mkdir(parents=True, exist_ok=True)
    link = [f"-L{lib_dir}", f"-l{lib}", f"-Wl,-rpath,{lib_dir}"] if lib else []
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        partial = Path(tmp) / out.name
        cmd = [cxx, *flags, "-std=c++17", "-shared", "-fPIC", "-w",
               *(f"-I{d}" for d in include), str(source), *link, "-o", str(partial)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as e:
            raise RuntimeError(f"cannot run the C++ compiler {cxx!r} ($CXX): {e}") from e
        if done.returncode != 0:
            raise RuntimeError(f"building {source.name} failed:\n{done.stderr[-2000:]}")
        os.replace(partial, out)


def handler_key(source: Path, flags: tuple[str, ...], *versions: str) -> str:
    """A built handler's identity: its source, build flags, the jax and jaxlib versions and
    those of what it links (``versions``)."""
    return hashlib.sha256(b"\0".join([
        source.read_bytes(), " ".join(flags).encode(), jax.__version__.encode(),
        jax.lib.__version__.encode(), *(v.encode() for v in versions)])).hexdigest()[:16]


def load_handler(source: Path, symbol: str, target: str, include: list[str],
                 flags: tuple[str, ...] = ("-O2",), lib_dir: str | None = None,
                 lib: str | None = None, versions: tuple[str, ...] = (),
                 headers: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """Build ``source`` into the kernel cache (once per ``handler_key``), load it and
    register its ``symbol`` with XLA as the CPU FFI target ``target``. ``headers``: our
    own headers it includes (their folders join ``include``, their text the key)."""
    if PARALLEL_HEADER in headers:
        load_parallel()
    include = [*include, *sorted({str(h.parent) for h in headers})]
    versions = (*versions, *(hashlib.sha256(h.read_bytes()).hexdigest()[:16] for h in headers))
    handle = ctypes.CDLL(str(_built(source, include, flags, lib_dir, lib, versions)))
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(handle, symbol)),
                                platform="cpu")
    return handle


def load_handlers(source: Path, targets: dict[str, str], flags: tuple[str, ...],
                  headers: tuple[Path, ...] = ()) -> ctypes.CDLL:
    """``load_handler`` for each ``symbol: target`` of one library built from ``source``
    (built once: the symbols share its key)."""
    for symbol, target in targets.items():
        handle = load_handler(source, symbol, target, [jax.ffi.include_dir()], flags,
                              headers=headers)
    return handle


def _built(source: Path, include: list[str], flags: tuple[str, ...], lib_dir: str | None,
           lib: str | None, versions: tuple[str, ...]) -> Path:
    """``source`` built into the kernel cache, once per ``handler_key``."""
    path = kernel_cache_dir() / f"{source.stem}-{handler_key(source, flags, *versions)}.so"
    if not path.exists():
        build_handler(source, path, include, lib_dir, lib, flags)
    return path


@functools.cache
def load_parallel() -> ctypes.CDLL:
    """The spinning workers every CPU handler splits its work over (``cpu_parallel.cc``),
    built and loaded once per process with its symbols global, before any handler that
    calls them is loaded: one set of workers for all handlers."""
    header = hashlib.sha256(PARALLEL_HEADER.read_bytes()).hexdigest()[:16]
    path = _built(_PARALLEL_SOURCE, [jax.ffi.include_dir(), str(PARALLEL_HEADER.parent)],
                  _PARALLEL_FLAGS, None, None, (header,))
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def library_key() -> str:
    """The handler's identity: its source and flags, the jax, jaxlib and OpenBLAS versions."""
    import scipy_openblas32 as blas

    return handler_key(_SOURCE, _FLAGS, blas.__version__)


@functools.cache
def load_library() -> ctypes.CDLL:
    """Build (once per source/version) and load the handler; register it with XLA.
    Raises RuntimeError naming what is missing (the wheel, a C++ compiler)."""
    try:
        import scipy_openblas32 as blas
    except ImportError as e:
        raise RuntimeError("the CPU GEMM needs the scipy-openblas32 wheel "
                           "(pip install scipy-openblas32)") from e
    return load_handler(_SOURCE, "ConfluxStackedGemm", TARGET,
                        [jax.ffi.include_dir(), blas.get_include_dir()], _FLAGS,
                        blas.get_lib_dir(), blas.get_library(), (blas.__version__,))


def loads(load: Callable[[], object]) -> tuple[bool, str]:
    """(whether ``load`` builds and loads its handler, why not: its RuntimeError)."""
    try:
        load()
    except RuntimeError as e:
        return False, str(e)
    return True, ""


def blas_available() -> tuple[bool, str]:
    """(whether ``stacked_matmul`` can run here, why not)."""
    return loads(load_library)


def stacked_matmul(
    x: jax.Array,  # f32[..., K]
    w: jax.Array,  # f32[L, K, N], or f32[L, N, K] with transpose_w
    layer: jax.Array | int,  # i32[] which of the L matrices
    transpose_w: bool = False,
) -> jax.Array:  # f32[..., N]
    """``x @ w[layer]`` (``x @ w[layer].T`` with ``transpose_w``) by OpenBLAS, reading the
    layer in place; fp32 on the CPU only (``load_library`` must have succeeded)."""
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"stacked_matmul is fp32 only, got {x.dtype} @ {w.dtype}")
    if w.ndim != 3:
        raise ValueError(f"w must be f32[L, K, N], got shape {w.shape}")
    k, n = (w.shape[2], w.shape[1]) if transpose_w else (w.shape[1], w.shape[2])
    if x.shape[-1] != k:
        raise ValueError(f"x's last axis is {x.shape[-1]}, w contracts {k}")
    load_library()
    lead = x.shape[:-1]
    rows = int(np.prod(lead, dtype=np.int64))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((rows, n), jnp.float32))
    out = call(x.reshape(rows, k), w, jnp.asarray(layer, jnp.int32), transpose_w=transpose_w)
    return out.reshape(*lead, n)


def stacked_matmul_xla(x: jax.Array, w: jax.Array, layer: jax.Array | int,
                       transpose_w: bool = False) -> jax.Array:
    """The same product in plain ``jnp``, fp32 sums (the oracle)."""
    w_l = jax.lax.dynamic_index_in_dim(w, jnp.asarray(layer, jnp.int32), keepdims=False)
    if transpose_w:
        w_l = w_l.T
    return jnp.matmul(x, w_l, preferred_element_type=jnp.float32)
