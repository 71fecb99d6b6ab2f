"""The dense reference of ragged paged attention: the oracle every implementation is tested
against (as JAX keeps ``ref_ragged_paged_attention`` beside its TPU kernel).

Deliberately naive: a Python loop over the live sequences, each gathering its KV entries
(page and offset of every position) through its page table and running one plain causally
masked softmax, in float64 numpy. No blocks, no online softmax, nothing shared with the fast
paths but the argument validation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from pallas_kernels.ragged_paged_attention.validation import validate

__all__ = ["ref_ragged_paged_attention"]


def ref_ragged_paged_attention(
    q: Any,  # f[T, Hq, d]
    k_pages: Any,  # f[P, page_size, Hkv, d]
    v_pages: Any,  # f[P, page_size, Hkv, d]
    kv_lens: Any,  # i32[S]
    page_indices: Any,  # i32[S, pages_per_seq]
    cu_q_lens: Any,  # i32[S+1]
    num_seqs: Any,  # i32[] or i32[1]
    *,
    sm_scale: float | None = None,
) -> np.ndarray:  # f64[T, Hq, d]
    """``ragged_paged_attention`` computed densely in float64 (concrete inputs only).

    Same contract as ``ragged_paged_attention``, except that the result is a float64 numpy
    array whatever the input dtype (an oracle should not round) and that the inputs must be
    concrete: the loop bounds are the metadata's values.
    """
    validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, sm_scale)
    q, k_pages, v_pages = (np.asarray(x).astype(np.float64) for x in (q, k_pages, v_pages))
    kv_lens, page_indices, cu = (np.asarray(x) for x in (kv_lens, page_indices, cu_q_lens))
    t, hq, d = q.shape
    page_size, hkv = k_pages.shape[1], k_pages.shape[2]
    scale = 1.0 / math.sqrt(d) if sm_scale is None else float(sm_scale)
    out = np.zeros((t, hq, d))  # tokens outside live sequences stay 0
    for s in range(int(np.asarray(num_seqs).reshape(()))):
        a, b, kv_len = int(cu[s]), int(cu[s + 1]), int(kv_lens[s])
        if a == b:
            continue
        pos = np.arange(kv_len)  # the sequence's KV positions, found through its page table
        page, offset = page_indices[s, pos // page_size], pos % page_size
        k = np.repeat(k_pages[page, offset], hq // hkv, axis=1)  # [L, Hq, d]: head h, KV h // g
        v = np.repeat(v_pages[page, offset], hq // hkv, axis=1)
        q_pos = kv_len - (b - a) + np.arange(b - a)  # this chunk is the last b - a positions
        logits = np.einsum("qhd,lhd->hql", q[a:b], k) * scale
        logits = np.where(pos[None, None, :] <= q_pos[None, :, None], logits, -np.inf)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        out[a:b] = np.einsum("hql,lhd->qhd", w / w.sum(-1, keepdims=True), v)
    return out
