"""The oracle's own oracle: ``ref_ragged_paged_attention`` (pallas_kernels.ragged_paged_attention
.reference) against a brute-force computation, one query token and head at a time, in plain
Python floats, on a tiny hand-built batch."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pallas_kernels.ragged_paged_attention import ref_ragged_paged_attention

PAGE_SIZE = 2


def tiny_batch() -> dict[str, np.ndarray]:
    """Four sequence slots, three live: a chunk after a 3-token history (kv 5 over 3 pages), an
    idle sequence (no query rows), a fresh 3-token prefill; two padding tokens; GQA 4 / 2."""
    rng = np.random.default_rng(0)
    t, hq, hkv, d, num_pages = 7, 4, 2, 3, 7
    return dict(
        q=rng.standard_normal((t, hq, d)).astype(np.float32),
        k_pages=rng.standard_normal((num_pages, PAGE_SIZE, hkv, d)).astype(np.float32),
        v_pages=rng.standard_normal((num_pages, PAGE_SIZE, hkv, d)).astype(np.float32),
        kv_lens=np.array([5, 1, 3, 40], np.int32),  # slot 3 is dead: garbage
        # Pages out of order; unused slots (and the dead row) hold garbage, even out of range.
        page_indices=np.array([[4, 0, 6], [2, -1, 9], [5, 1, 99], [-7, 3, 3]], np.int32),
        cu_q_lens=np.array([0, 2, 2, 5, 1], np.int32),
        num_seqs=np.int32(3),
    )


def brute_force(b: dict[str, np.ndarray], scale: float) -> np.ndarray:
    """Per query token and head: find its sequence and position, read every visible key and
    value through the page table, softmax over the scores. f64[T, Hq, d]."""
    q, kp, vp = b["q"], b["k_pages"], b["v_pages"]
    t, hq, d = q.shape
    group = hq // kp.shape[2]
    cu, kv_lens, table = b["cu_q_lens"], b["kv_lens"], b["page_indices"]
    out = np.zeros((t, hq, d))
    for tok in range(t):
        owners = [s for s in range(int(b["num_seqs"])) if cu[s] <= tok < cu[s + 1]]
        if not owners:
            continue  # padding token: zero row
        (s,) = owners
        pos = int(kv_lens[s]) - int(cu[s + 1] - cu[s]) + int(tok - cu[s])
        for h in range(hq):
            scores, values = [], []
            for j in range(pos + 1):  # causal: keys 0 .. pos
                page, offset = table[s, j // PAGE_SIZE], j % PAGE_SIZE
                key = kp[page, offset, h // group]
                scores.append(scale * sum(float(q[tok, h, i]) * float(key[i]) for i in range(d)))
                values.append(vp[page, offset, h // group])
            top = max(scores)
            weights = [math.exp(x - top) for x in scores]
            total = sum(weights)
            for i in range(d):
                num = sum(w * float(v[i]) for w, v in zip(weights, values, strict=True))
                out[tok, h, i] = num / total
    return out


@pytest.mark.parametrize("sm_scale", [None, 0.3])
def test_reference_matches_brute_force(sm_scale: float | None) -> None:
    b = tiny_batch()
    out = ref_ragged_paged_attention(*b.values(), sm_scale=sm_scale)
    assert out.dtype == np.float64 and out.shape == b["q"].shape
    scale = 1.0 / math.sqrt(b["q"].shape[2]) if sm_scale is None else sm_scale
    want = brute_force(b, scale)
    assert (want[5:] == 0).all() and (want[:5] != 0).all()  # the case covers what it should
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    # num_seqs as i32[1] is the same call; fewer live sequences zero the rest.
    one = dict(b, num_seqs=np.array([1], np.int32))
    np.testing.assert_allclose(
        ref_ragged_paged_attention(*one.values(), sm_scale=sm_scale),
        np.where(np.arange(7)[:, None, None] < 2, want, 0),
        rtol=1e-12,
        atol=1e-12,
    )
