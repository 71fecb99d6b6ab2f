"""Shared helpers for the Pallas kernels: implementation dispatch and small utilities.

Every op in this package has three implementations, the values of its ``impl`` argument:

* ``"xla"``: pure ``jnp``, compiled by XLA (the fast path on CPU),
* ``"pallas"``: the Pallas kernel compiled for the GPU through Pallas' Triton lowering,
* ``"interpret"``: the same Pallas kernel body run with ``interpret=True`` (any backend; tests).

Attention over the combined K/V pool (``ragged_paged_attention.combined``) has a fourth,
``"tpu"``: JAX's own Mosaic kernel (``jax.experimental.pallas.ops.tpu``), on a TPU backend.

``impl=None`` means auto: the ``CONFLUX_ATTENTION_IMPL`` environment variable when set,
otherwise ``"pallas"`` on a GPU backend, ``"tpu"`` on a TPU backend for the combined pool, and
``"xla"`` everywhere else. Besides these, every op has a plain numpy reference (``ref_*``),
the oracle the tests check all three against.
"""

from __future__ import annotations

import os
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

IMPL_ENV_VAR = "CONFLUX_ATTENTION_IMPL"
IMPLS = ("xla", "pallas", "interpret")
TPU_IMPL = "tpu"  # JAX's TPU kernel: only over the combined K/V pool
_RENAMED = {"reference": "xla"}  # impl values of earlier versions


def on_gpu() -> bool:
    """True when JAX's default backend is a GPU (CUDA or ROCm)."""
    return jax.default_backend() == "gpu"


def on_tpu() -> bool:
    """True when JAX's default backend is a TPU."""
    return jax.default_backend() == "tpu"


def asked_impl(impl: str | None) -> str | None:
    """The implementation asked for by name (the argument, else the env var); None = auto."""
    return impl or os.environ.get(IMPL_ENV_VAR, "").strip().lower() or None


def resolve_impl(impl: str | None, combined_kv: bool = False) -> str:
    """Turns the ``impl`` argument (or the env var, or the backend) into one of ``IMPLS``, or
    ``"tpu"`` for an op over the combined K/V pool (``combined_kv``)."""
    source = "impl"
    if impl is None:
        impl, source = asked_impl(None), f"${IMPL_ENV_VAR}"
        if impl is None:
            if combined_kv and on_tpu():
                return TPU_IMPL
            return "pallas" if on_gpu() else "xla"
    if impl == TPU_IMPL:
        if not combined_kv:
            raise ValueError(
                f"{source}='tpu' is JAX's TPU kernel, which reads one combined K/V pool: use "
                "ragged_paged_attention_combined (the step does, with kv_layout='combined')")
        if not on_tpu():
            raise ValueError(f"{source}='tpu' runs JAX's Mosaic kernel on a TPU, but JAX's "
                             f"default backend is {jax.default_backend()!r}")
        return impl
    if impl not in IMPLS:
        renamed = _RENAMED.get(impl) if isinstance(impl, str) else None
        hint = f"; {impl!r} is now called {renamed!r}" if renamed else ""
        allowed = (*IMPLS, TPU_IMPL) if combined_kv else IMPLS
        raise ValueError(f"{source}={impl!r} is not one of {allowed} (or None for auto){hint}")
    if impl == "pallas" and not on_gpu():
        raise ValueError(
            f"{source}='pallas' compiles the kernel for a GPU, but JAX's default backend is "
            f"{jax.default_backend()!r}; use 'interpret' or 'xla' here"
        )
    return impl


def impls_under_test() -> list[str]:
    """Implementations the tests exercise: ``$CONFLUX_KERNEL_TEST_IMPLS`` (comma-separated) or
    xla + interpret, plus compiled pallas on a GPU."""
    env = os.environ.get("CONFLUX_KERNEL_TEST_IMPLS", "").strip()
    if env:
        impls = [i.strip() for i in env.split(",") if i.strip()]
        bad = [i for i in impls if i not in IMPLS]
        if bad:
            raise ValueError(f"CONFLUX_KERNEL_TEST_IMPLS: unknown {bad}, expected some of {IMPLS}")
        return impls
    return ["xla", "interpret"] + (["pallas"] if on_gpu() else [])


def triton_module() -> ModuleType:
    """``jax.experimental.pallas.triton``, imported only when a kernel is actually traced."""
    from jax.experimental.pallas import triton as plgpu

    return plgpu


def is_pow2(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_tracer(x: object) -> bool:
    return isinstance(x, jax.core.Tracer)


def concrete_or_none(x: object) -> np.ndarray | None:
    """``x`` as a numpy array when its value is known now (not a tracer), else None."""
    if is_tracer(x):
        return None
    try:
        return np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def check_int_array(name: str, x: object, ndim_options: tuple[int, ...]) -> tuple[int, ...]:
    """Checks that ``x`` is an integer array with one of the allowed ranks; returns its shape."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"{name} must be an integer array, got {type(x).__name__}")
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype (int32), got {dtype}")
    if len(shape) not in ndim_options:
        ranks = " or ".join(str(r) for r in ndim_options)
        raise ValueError(f"{name} must have rank {ranks}, got shape {tuple(shape)}")
    return tuple(shape)


def check_float_array(name: str, x: object, ndim: int) -> tuple[int, ...]:
    """Checks that ``x`` is a floating array of rank ``ndim``; returns its shape."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is None or dtype is None:
        raise ValueError(f"{name} must be a floating-point array, got {type(x).__name__}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {dtype}")
    if len(shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim}, got shape {tuple(shape)}")
    return tuple(shape)
