"""The step's input arrays: fixed shapes, built on the host from an ``IterationPlan``.

Per-rank arrays have a leading ``[N]`` axis sharded over ``sp``; the prefill attention
metadata is the same on every rank (after the all-to-all each rank holds every prefill
token for its head shard) and is replicated. Shapes use: N ranks, T token slots, P prefill
slots, D decode slots, S prefill sequences, R = D + S sampling rows, Wd / Wp page-table
widths (decode / prefill view), X transfer page groups.

Padding conventions: KV slots ``-1`` never write; buffer indices ``T`` are dropped on
scatter; page ids ``num_pages`` are dropped on the transfer scatter.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    # --- per rank, sharded over sp -----------------------------------------------------
    tokens: jax.Array  # i32[N, T]   prefill tokens, then decode tokens, then padding
    positions: jax.Array  # i32[N, T]   absolute position of each token
    decode_index: jax.Array  # i32[N, D]   buffer index of each decode slot (pad: T)
    decode_slot: jax.Array  # i32[N, D]   decode-view KV slot page*ps+offset (pad: -1)
    decode_kv_len: jax.Array  # i32[N, D]   KV length after this token
    decode_pages: jax.Array  # i32[N, D, Wd] decode-view page table
    num_decode: jax.Array  # i32[N]      live decode slots on the rank
    prefill_slot: jax.Array  # i32[N, N*P] prefill-view KV slot per kernel-ordered token
    prefill_pages: jax.Array  # i32[N, S, Wp] prefill-view page table (per-rank page ids)
    transfer_src: jax.Array  # i32[N, X]   prefill-view pages to move (one page group each)
    transfer_dst: jax.Array  # i32[N, X*N] decode-view destination pages here (pad: pages)
    sample_index: jax.Array  # i32[N, R]   buffer index whose logits are sampled
    temperature: jax.Array  # f32[N, R]
    top_k: jax.Array  # i32[N, R]
    top_p: jax.Array  # f32[N, R]
    seed: jax.Array  # u32[N, R]
    sample_step: jax.Array  # i32[N, R]   output index being sampled (per-request key)
    # --- replicated ---------------------------------------------------------------------
    prefill_perm: jax.Array  # i32[N*P] kernel order -> all-to-all buffer index
    prefill_inverse: jax.Array  # i32[N*P] all-to-all buffer index -> kernel order
    prefill_cu_q_lens: jax.Array  # i32[S+1]
    prefill_kv_lens: jax.Array  # i32[S]
    prefill_num_seqs: jax.Array  # i32[1]


PER_RANK_FIELDS = tuple(f.name for f in dataclasses.fields(StepBatch)
                        if not f.name.startswith("prefill_") or f.name in
                        ("prefill_slot", "prefill_pages"))


def zeros_like_shapes(n: int, t: int, p: int, d: int, s: int, wd: int, wp: int,
                      x: int) -> dict[str, np.ndarray]:
    """Host buffers for one step shape, filled with padding values."""
    s = s if p else 1  # no prefill slice: no prefill sequences, and no sampling rows for them
    r = d + s
    i32 = np.int32
    return {
        "tokens": np.zeros((n, t), i32),
        "positions": np.zeros((n, t), i32),
        "decode_index": np.full((n, d), t, i32),
        "decode_slot": np.full((n, d), -1, i32),
        "decode_kv_len": np.zeros((n, d), i32),
        "decode_pages": np.zeros((n, d, wd), i32),
        "num_decode": np.zeros((n,), i32),
        "prefill_slot": np.full((n, n * p), -1, i32),
        "prefill_pages": np.zeros((n, s, wp), i32),
        "transfer_src": np.zeros((n, x), i32),
        "transfer_dst": np.zeros((n, x * n), i32),  # caller sets the OOB pad value
        "sample_index": np.zeros((n, r), i32),
        "temperature": np.zeros((n, r), np.float32),
        "top_k": np.zeros((n, r), i32),
        "top_p": np.ones((n, r), np.float32),
        "seed": np.zeros((n, r), np.uint32),
        "sample_step": np.zeros((n, r), i32),
        "prefill_perm": np.arange(n * p, dtype=i32),
        "prefill_inverse": np.arange(n * p, dtype=i32),
        "prefill_cu_q_lens": np.zeros((s + 1,), i32),
        "prefill_kv_lens": np.zeros((s,), i32),
        "prefill_num_seqs": np.zeros((1,), i32),
    }
