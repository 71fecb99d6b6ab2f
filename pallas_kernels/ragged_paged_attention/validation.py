"""Argument checks shared by every implementation: shapes and dtypes always, metadata values
when they are concrete (not traced), all before anything is traced."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from pallas_kernels._common import cdiv, check_float_array, check_int_array, concrete_or_none

__all__ = ["Dims", "softmax_scale", "validate"]


class Dims(NamedTuple):
    num_tokens: int  # T
    num_q_heads: int  # Hq
    head_dim: int  # d
    num_pages: int  # P
    page_size: int
    num_kv_heads: int  # Hkv
    max_seqs: int  # S
    pages_per_seq: int


def validate(
    q: Any,  # f[T, Hq, d]
    k_pages: Any,  # f[P, page_size, Hkv, d]
    v_pages: Any,  # f[P, page_size, Hkv, d]
    kv_lens: Any,  # i32[S]
    page_indices: Any,  # i32[S, pages_per_seq]
    cu_q_lens: Any,  # i32[S+1]
    num_seqs: Any,  # i32[] or i32[1]
    sm_scale: float | None,
) -> Dims:
    """Static (shape / dtype) checks, plus value checks when the metadata is concrete."""
    t, hq, d = check_float_array("q", q, 3)
    p, ps, hkv, dk = check_float_array("k_pages", k_pages, 4)
    check_float_array("v_pages", v_pages, 4)
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise ValueError(
            f"k_pages and v_pages must have the same shape [P, page_size, Hkv, d], got "
            f"{tuple(k_pages.shape)} and {tuple(v_pages.shape)}"
        )
    if not (q.dtype == k_pages.dtype == v_pages.dtype):
        raise ValueError(
            f"q, k_pages and v_pages must share one dtype, got {q.dtype}, {k_pages.dtype}, "
            f"{v_pages.dtype}"
        )
    if dk != d:
        raise ValueError(f"head dim mismatch: q has d={d}, k_pages/v_pages have d={dk}")
    if min(t, hq, d, p, ps, hkv) < 1:
        raise ValueError(f"empty dimension: q {tuple(q.shape)}, k_pages {tuple(k_pages.shape)}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} query heads is not a multiple of Hkv={hkv} KV heads")
    (s,) = check_int_array("kv_lens", kv_lens, (1,))
    s_pt, pps = check_int_array("page_indices", page_indices, (2,))
    (s1,) = check_int_array("cu_q_lens", cu_q_lens, (1,))
    ns_shape = check_int_array("num_seqs", num_seqs, (0, 1))
    if s < 1:
        raise ValueError("kv_lens must describe at least one sequence slot (S >= 1)")
    if s_pt != s:
        raise ValueError(f"page_indices has {s_pt} rows but kv_lens describes S={s} sequences")
    if pps < 1:
        raise ValueError("page_indices must have at least one page per sequence")
    if s1 != s + 1:
        raise ValueError(f"cu_q_lens must have S+1={s + 1} entries (S={s} from kv_lens), got {s1}")
    if ns_shape not in ((), (1,)):
        raise ValueError(f"num_seqs must be a scalar or shape (1,), got {ns_shape}")
    if sm_scale is not None and not (isinstance(sm_scale, int | float) and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be a finite float or None, got {sm_scale!r}")
    dims = Dims(t, hq, d, p, ps, hkv, s, pps)
    _check_values(dims, kv_lens, page_indices, cu_q_lens, num_seqs)
    return dims


def _check_values(
    dims: Dims, kv_lens: Any, page_indices: Any, cu_q_lens: Any, num_seqs: Any
) -> None:
    """Metadata consistency for live sequences; skipped when any of it is traced."""
    vals = [concrete_or_none(x) for x in (kv_lens, page_indices, cu_q_lens, num_seqs)]
    if any(v is None for v in vals):
        return
    kv, pt, cu, ns = vals
    n = int(ns.reshape(()))
    if not 0 <= n <= dims.max_seqs:
        raise ValueError(f"num_seqs={n} is outside [0, S={dims.max_seqs}]")
    cu = cu[: n + 1].astype(np.int64)
    if cu[0] != 0:
        raise ValueError(f"cu_q_lens[0] must be 0, got {cu[0]}")
    q_lens = np.diff(cu)
    if (q_lens < 0).any():
        raise ValueError(f"cu_q_lens must be non-decreasing over live sequences, got {cu}")
    if cu[-1] > dims.num_tokens:
        raise ValueError(
            f"cu_q_lens[num_seqs]={cu[-1]} exceeds the token axis of q (T={dims.num_tokens})"
        )
    kv = kv[:n].astype(np.int64)
    if (kv < q_lens).any():
        bad = int(np.argmax(kv < q_lens))
        raise ValueError(
            f"sequence {bad}: kv_lens={kv[bad]} is smaller than its query length {q_lens[bad]} "
            "(kv_lens counts history plus this step's tokens)"
        )
    capacity = dims.pages_per_seq * dims.page_size
    if (kv > capacity).any():
        bad = int(np.argmax(kv > capacity))
        raise ValueError(
            f"sequence {bad}: kv_lens={kv[bad]} exceeds pages_per_seq*page_size={capacity}"
        )
    for i in range(n):
        used = pt[i, : cdiv(int(kv[i]), dims.page_size)]
        if ((used < 0) | (used >= dims.num_pages)).any():
            raise ValueError(
                f"sequence {i}: page_indices {used.tolist()} reference pages outside "
                f"[0, {dims.num_pages})"
            )


def softmax_scale(dims: Dims, sm_scale: float | None) -> float:
    """The logit scale: ``sm_scale``, by default ``1/sqrt(d)``."""
    return 1.0 / math.sqrt(dims.head_dim) if sm_scale is None else float(sm_scale)
