"""Tests for pallas_kernels.kv_write: rows land exactly in their slots and nowhere else (every
impl against the numpy reference ``ref_write_kv``, which is itself checked by hand)."""

from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pallas_kernels import _common, ref_write_kv, write_kv, write_kv_xla

kv_mod = importlib.import_module("pallas_kernels.kv_write")
IMPLS = _common.impls_under_test()
SETTINGS = settings(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


def test_reference_by_hand() -> None:
    """The oracle itself: two pages of two slots, one KV head of dim 1; padding never writes."""
    pools = np.zeros((2, 2, 1, 1), np.float32)
    k_new = np.array([1, 2, 3, 4], np.float32).reshape(4, 1, 1)
    k, v = ref_write_kv(pools, pools + 9, k_new, -k_new, np.array([3, -1, 0, 4], np.int32))
    np.testing.assert_array_equal(k.ravel(), [3, 0, 0, 1])  # slot 0 <- token 2, 3 <- token 0
    np.testing.assert_array_equal(v.ravel(), [-3, 9, 9, -1])
    assert (pools == 0).all()  # the inputs are not modified


@st.composite
def writes(draw: st.DrawFn) -> dict[str, Any]:
    num_pages = 6
    page_size = draw(st.sampled_from([16, 64]))
    hkv = draw(st.sampled_from([1, 3]))
    head_dim = draw(st.sampled_from([64, 128]))
    dtype = draw(st.sampled_from([jnp.float32, jnp.bfloat16]))
    num_tokens = 37
    rng = np.random.default_rng(draw(st.integers(0, 2**31 - 1)))
    num_slots = num_pages * page_size
    slots = rng.permutation(num_slots)[:num_tokens].astype(np.int32)
    # Padding: negative slots; also a slot past the pool's end, which must not write either.
    kinds = rng.choice(3, num_tokens, p=[0.7, 0.2, 0.1])
    slots[kinds == 1] = rng.integers(-100, 0, (kinds == 1).sum())
    slots[kinds == 2] = num_slots + rng.integers(0, 50, (kinds == 2).sum())

    def rand(*shape: int, dt: Any = dtype) -> jax.Array:
        return jnp.asarray(rng.standard_normal(shape, np.float32), dt)

    new_dtype = draw(st.sampled_from([dtype, jnp.float32]))  # f32 rows into a bf16 pool: cast
    return dict(
        k_pages=rand(num_pages, page_size, hkv, head_dim),
        v_pages=rand(num_pages, page_size, hkv, head_dim),
        k_new=rand(num_tokens, hkv, head_dim, dt=new_dtype),
        v_new=rand(num_tokens, hkv, head_dim, dt=new_dtype),
        slot_mapping=slots,
    )


ARGS = ("k_pages", "v_pages", "k_new", "v_new", "slot_mapping")


@settings(SETTINGS, max_examples=15)
@given(writes())
def test_writes_land_exactly_in_their_slots(case: dict[str, Any]) -> None:
    want_k, want_v = ref_write_kv(*(case[a] for a in ARGS))
    for impl in IMPLS:
        k, v = write_kv(*(case[a] for a in ARGS), impl=impl)
        assert k.dtype == case["k_pages"].dtype and k.shape == case["k_pages"].shape
        np.testing.assert_array_equal(np.asarray(k), want_k, err_msg=impl)
        np.testing.assert_array_equal(np.asarray(v), want_v, err_msg=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_donated_pools_update_in_place(impl: str) -> None:
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.standard_normal((4, 16, 2, 64), np.float32))
    v = jnp.asarray(rng.standard_normal((4, 16, 2, 64), np.float32))
    new = jnp.ones((3, 2, 64), jnp.float32)
    slots = np.array([5, -1, 63], np.int32)
    want_k, _ = ref_write_kv(k, v, new, new, slots)
    step = jax.jit(lambda *a: write_kv(*a, impl=impl), donate_argnums=(0, 1))
    hlo = step.lower(k, v, new, new, slots).compile().as_text()
    k2, _ = step(k, v, new, new, slots)
    assert k.is_deleted()  # the buffer was donated to (and reused for) the result
    np.testing.assert_array_equal(np.asarray(k2), want_k)
    if impl == "xla":
        assert " copy(" not in hlo and "copy-start" not in hlo


BAD = {
    "pool shapes": (dict(v_pages=lambda x: x[:1]), "k_pages and v_pages must match"),
    "new shapes": (dict(v_new=lambda x: x[:1]), "k_new and v_new must have the same shape"),
    "heads": (dict(k_new=lambda x: x[:, :1], v_new=lambda x: x[:, :1]), "Hkv=1"),
    "slots length": (dict(slot_mapping=lambda x: x[:2]), "slot_mapping has 2 entries for T=3"),
    "slot dtype": (dict(slot_mapping=lambda x: x.astype(np.float32)), "integer dtype"),
    "pool rank": (dict(k_pages=lambda x: x[0], v_pages=lambda x: x[0]), "rank 4"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_invalid_inputs_raise_before_tracing(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def never(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("traced despite invalid inputs")

    monkeypatch.setattr(kv_mod, "_write_kv_xla", never)
    monkeypatch.setattr(kv_mod, "_write_kv_pallas", never)
    case = dict(
        k_pages=np.zeros((2, 16, 2, 64), np.float32),
        v_pages=np.zeros((2, 16, 2, 64), np.float32),
        k_new=np.zeros((3, 2, 64), np.float32),
        v_new=np.zeros((3, 2, 64), np.float32),
        slot_mapping=np.zeros((3,), np.int32),
    )
    changes, match = BAD[name]
    for key, fn in changes.items():
        case[key] = fn(case[key])
    with pytest.raises(ValueError, match=match):
        write_kv(*(case[a] for a in ARGS), impl="interpret")
    with pytest.raises(ValueError, match=match):
        write_kv_xla(*(case[a] for a in ARGS))
    with pytest.raises(ValueError, match=match):
        ref_write_kv(*(case[a] for a in ARGS))


def test_kernel_lowers_for_cuda() -> None:
    pools = jnp.zeros((8, 16, 3, 128), jnp.bfloat16)
    new = jnp.zeros((21, 3, 128), jnp.bfloat16)
    traced = kv_mod._write_kv_pallas.trace(
        pools, pools, new, new, jnp.zeros((21,), jnp.int32), block_t=16, interpret=False
    )
    text = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text
