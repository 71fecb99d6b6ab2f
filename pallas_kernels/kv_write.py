"""KV write: scatter this step's new K/V rows into their (page, offset) slots of the pools.

Token ``t`` goes to slot ``slot_mapping[t] = page * page_size + offset`` of the pools
``[P, page_size, Hkv, d]`` viewed as ``[P * page_size, Hkv, d]``. A negative slot marks a
padding token, which never writes; so does a slot past the end of the pool. Two live tokens
must not share a slot (which one lands would be unspecified).

Both fast implementations update the pools in place when the caller donates them
(``jax.jit(..., donate_argnums=(0, 1))``): the XLA path (``impl="xla"``) is one
``.at[].set(mode="drop")`` scatter per pool with padding aimed past the end, the Pallas kernel
aliases each pool to its output (``input_output_aliases``) and only stores the live rows.
``ref_write_kv`` is the numpy oracle the tests check both against: one token at a time.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels._common import (
    cdiv,
    check_float_array,
    check_int_array,
    is_pow2,
    resolve_impl,
    triton_module,
)

__all__ = ["ref_write_kv", "write_kv", "write_kv_xla"]


def _validate(
    k_pages: Any, v_pages: Any, k_new: Any, v_new: Any, slot_mapping: Any
) -> tuple[int, int, int, int, int]:
    p, ps, hkv, d = check_float_array("k_pages", k_pages, 4)
    check_float_array("v_pages", v_pages, 4)
    if tuple(v_pages.shape) != tuple(k_pages.shape) or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"k_pages and v_pages must match, got {tuple(k_pages.shape)} {k_pages.dtype} and "
            f"{tuple(v_pages.shape)} {v_pages.dtype}"
        )
    t, hkv_new, d_new = check_float_array("k_new", k_new, 3)
    check_float_array("v_new", v_new, 3)
    if tuple(v_new.shape) != tuple(k_new.shape):
        raise ValueError(
            f"k_new and v_new must have the same shape, got {tuple(k_new.shape)} and "
            f"{tuple(v_new.shape)}"
        )
    if (hkv_new, d_new) != (hkv, d):
        raise ValueError(
            f"k_new/v_new rows are [Hkv={hkv_new}, d={d_new}] but the pools hold [Hkv={hkv}, d={d}]"
        )
    (t_slots,) = check_int_array("slot_mapping", slot_mapping, (1,))
    if t_slots != t:
        raise ValueError(f"slot_mapping has {t_slots} entries for T={t} new tokens")
    return p, ps, hkv, d, t


@jax.jit
def _write_kv_xla(
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    k_new: jax.Array,  # f[T, Hkv, d]
    v_new: jax.Array,  # f[T, Hkv, d]
    slot_mapping: jax.Array,  # i32[T]
) -> tuple[jax.Array, jax.Array]:
    p, ps, hkv, d = k_pages.shape
    num_slots = p * ps
    slots = jnp.asarray(slot_mapping, jnp.int32)
    # Negative indices would wrap around; aim padding past the end, where mode="drop" skips it.
    slots = jnp.where((slots >= 0) & (slots < num_slots), slots, num_slots)

    def put(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(num_slots, hkv, d)
        return flat.at[slots].set(new.astype(pages.dtype), mode="drop").reshape(pages.shape)

    return put(k_pages, k_new), put(v_pages, v_new)


def write_kv_xla(
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    k_new: jax.Array,  # f[T, Hkv, d]
    v_new: jax.Array,  # f[T, Hkv, d]
    slot_mapping: jax.Array,  # i32[T]
) -> tuple[jax.Array, jax.Array]:  # (f[P, page_size, Hkv, d], f[P, page_size, Hkv, d])
    """The XLA path of ``write_kv`` (pure ``jnp``: one scatter per pool)."""
    _validate(k_pages, v_pages, k_new, v_new, slot_mapping)
    return _write_kv_xla(k_pages, v_pages, k_new, v_new, slot_mapping)


def ref_write_kv(
    k_pages: Any,  # f[P, page_size, Hkv, d]
    v_pages: Any,  # f[P, page_size, Hkv, d]
    k_new: Any,  # f[T, Hkv, d]
    v_new: Any,  # f[T, Hkv, d]
    slot_mapping: Any,  # i32[T]
) -> tuple[np.ndarray, np.ndarray]:  # (f[P, page_size, Hkv, d], f[P, page_size, Hkv, d])
    """Numpy reference of ``write_kv`` (concrete inputs): a loop over the tokens, each row cast
    to the pools' dtype and written to its slot when the slot is inside the pool."""
    _validate(k_pages, v_pages, k_new, v_new, slot_mapping)
    p, ps, hkv, d = k_pages.shape
    slots = np.asarray(slot_mapping)

    def put(pages: np.ndarray, new: np.ndarray) -> np.ndarray:
        flat = pages.reshape(p * ps, hkv, d).copy()
        for t, slot in enumerate(slots):
            if 0 <= slot < p * ps:
                flat[slot] = new[t].astype(flat.dtype)
        return flat.reshape(pages.shape)

    return (put(np.asarray(k_pages), np.asarray(k_new)),
            put(np.asarray(v_pages), np.asarray(v_new)))


def _write_kv_kernel(
    slot_ref: Any,  # i32[T]
    k_new_ref: Any,  # f[T, Hkv, d]
    v_new_ref: Any,  # f[T, Hkv, d]
    k_in_ref: Any,  # f[P*page_size, Hkv, d]  aliased to k_out_ref, never read
    v_in_ref: Any,  # f[P*page_size, Hkv, d]  aliased to v_out_ref, never read
    k_out_ref: Any,  # f[P*page_size, Hkv, d]
    v_out_ref: Any,  # f[P*page_size, Hkv, d]
    *,
    block_t: int,
) -> None:
    del k_in_ref, v_in_ref
    plgpu = triton_module()
    blk, head = pl.program_id(0), pl.program_id(1)
    num_tokens, _, head_dim = k_new_ref.shape
    num_slots = k_out_ref.shape[0]
    tok = blk * block_t + lax.iota(jnp.int32, block_t)
    tok_ok = tok < num_tokens
    src = jnp.where(tok_ok, tok, 0)
    slot = plgpu.load(slot_ref.at[src], mask=tok_ok, other=-1)
    ok = tok_ok & (slot >= 0) & (slot < num_slots)
    # Rows that must not write point past the end: masked on GPU, dropped by interpret.
    dst = jnp.where(ok, slot, num_slots)
    cols = lax.iota(jnp.int32, head_dim)
    mask = jnp.broadcast_to(ok[:, None], (block_t, head_dim))
    for new_ref, out_ref in ((k_new_ref, k_out_ref), (v_new_ref, v_out_ref)):
        rows = plgpu.load(new_ref.at[src[:, None], head, cols[None, :]], mask=mask, other=0)
        plgpu.store(
            out_ref.at[dst[:, None], head, cols[None, :]], rows.astype(out_ref.dtype), mask=mask
        )


@functools.partial(jax.jit, static_argnames=("block_t", "interpret"))
def _write_kv_pallas(
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    k_new: jax.Array,  # f[T, Hkv, d]
    v_new: jax.Array,  # f[T, Hkv, d]
    slot_mapping: jax.Array,  # i32[T]
    *,
    block_t: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    plgpu = triton_module()
    p, ps, hkv, d = k_pages.shape
    t = k_new.shape[0]
    flat = jax.ShapeDtypeStruct((p * ps, hkv, d), k_pages.dtype)
    k_out, v_out = pl.pallas_call(
        functools.partial(_write_kv_kernel, block_t=block_t),
        grid=(cdiv(t, block_t), hkv),
        out_shape=(flat, flat),
        input_output_aliases={3: 0, 4: 1},
        interpret=interpret,
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
        name="write_kv",
    )(
        jnp.asarray(slot_mapping, jnp.int32),
        k_new,
        v_new,
        k_pages.reshape(p * ps, hkv, d),
        v_pages.reshape(p * ps, hkv, d),
    )
    return k_out.reshape(k_pages.shape), v_out.reshape(v_pages.shape)


def write_kv(
    k_pages: jax.Array,  # f[P, page_size, Hkv, d]
    v_pages: jax.Array,  # f[P, page_size, Hkv, d]
    k_new: jax.Array,  # f[T, Hkv, d]
    v_new: jax.Array,  # f[T, Hkv, d]
    slot_mapping: jax.Array,  # i32[T]
    *,
    impl: str | None = None,
    block_t: int = 16,
) -> tuple[jax.Array, jax.Array]:  # (f[P, page_size, Hkv, d], f[P, page_size, Hkv, d])
    """Writes the step's new K/V rows into their slots; returns the updated pools.

    Args:
      k_pages, v_pages: f[P, page_size, Hkv, d] pools (donate them for an in-place update).
      k_new, v_new: f[T, Hkv, d] new rows, cast to the pools' dtype.
      slot_mapping: i32[T] ``page * page_size + offset``; negative (padding) never writes.
      impl: None (auto; ``$CONFLUX_ATTENTION_IMPL`` overrides), "xla", "pallas" or
        "interpret".
      block_t: tokens per Pallas program (power of two).

    Raises:
      ValueError: inconsistent shapes or dtypes, before anything is traced.
    """
    _, _, _, d, _ = _validate(k_pages, v_pages, k_new, v_new, slot_mapping)
    impl = resolve_impl(impl)
    if impl == "xla":
        return _write_kv_xla(k_pages, v_pages, k_new, v_new, slot_mapping)
    if not (is_pow2(block_t) and is_pow2(d)):
        raise ValueError(
            f"the Pallas KV write needs power-of-two block_t and head dim, got block_t={block_t}, "
            f"d={d}; use impl='xla'"
        )
    return _write_kv_pallas(
        k_pages,
        v_pages,
        k_new,
        v_new,
        slot_mapping,
        block_t=block_t,
        interpret=impl == "interpret",
    )
