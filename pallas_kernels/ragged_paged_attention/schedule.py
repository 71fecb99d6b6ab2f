"""The query-block schedule shared by the XLA path and the Pallas kernel.

The packed queries are cut into blocks of ``block_q`` tokens of one sequence each (a
sequence's last block may be partial). Blocks are numbered sequence-major: live blocks first,
then idle padding blocks (``seq == -1``) up to the static bound ``num_blocks``, so that any
step of ``T`` tokens over ``S`` sequence slots fits one compiled program.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Schedule", "build_schedule", "num_blocks", "prepare_metadata", "short_queries",
           "token_mask"]


def short_queries(num_tokens: int, max_seqs: int, query_len: str | None = None) -> bool:
    """Tile as decode (a token or two per sequence)? ``query_len`` "short"/"long" says so;
    None guesses from the shapes (``num_tokens <= 2 * max_seqs``)."""
    if query_len is None:
        return num_tokens <= 2 * max_seqs
    if query_len not in ("short", "long"):
        raise ValueError(f"query_len must be None, 'short' or 'long', got {query_len!r}")
    return query_len == "short"


class Schedule(NamedTuple):
    seq: jax.Array  # i32[G]  sequence of each query block; -1 = idle block
    tok0: jax.Array  # i32[G]  first token (row of q) of the block
    ntok: jax.Array  # i32[G]  valid tokens in the block (0 when idle)
    pos0: jax.Array  # i32[G]  absolute KV position of the block's first token


def num_blocks(num_tokens: int, max_seqs: int, block_q: int) -> int:
    """Static bound on the number of query blocks of any step of ``num_tokens`` tokens."""
    # sum_s ceil(q_s / B) <= sum_s (q_s + B - 1) / B <= (T + S (B - 1)) / B
    return max(1, (num_tokens + max_seqs * (block_q - 1)) // block_q)


def _live_cu(cu_q_lens: jax.Array, num_seqs: jax.Array) -> jax.Array:
    """cu_q_lens with every dead sequence made empty (garbage metadata is ignored)."""
    idx = jnp.arange(cu_q_lens.shape[0], dtype=jnp.int32)
    return jnp.where(idx <= num_seqs, cu_q_lens, cu_q_lens[num_seqs])


def build_schedule(
    cu: jax.Array,  # i32[S+1], dead sequences already emptied by prepare_metadata
    kv_lens: jax.Array,  # i32[S]
    *,
    num_tokens: int,
    block_q: int,
) -> Schedule:
    """Query block ``g`` of the step: its sequence, first token, token count and position."""
    s = kv_lens.shape[0]
    g_total = num_blocks(num_tokens, s, block_q)
    q_lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    nblk = (q_lens + block_q - 1) // block_q
    blk_end = jnp.cumsum(nblk).astype(jnp.int32)
    blk_begin = blk_end - nblk
    g = jnp.arange(g_total, dtype=jnp.int32)
    seq = jnp.searchsorted(blk_end, g, side="right").astype(jnp.int32)
    busy = seq < s
    seq_c = jnp.minimum(seq, s - 1)
    start = (g - blk_begin[seq_c]) * block_q  # offset of the block inside its sequence
    ntok = jnp.where(busy, jnp.clip(q_lens[seq_c] - start, 0, block_q), 0)
    return Schedule(
        seq=jnp.where(busy & (ntok > 0), seq_c, -1),
        tok0=cu[seq_c] + start,
        ntok=ntok,
        pos0=kv_lens[seq_c] - q_lens[seq_c] + start,
    )


def token_mask(cu: jax.Array, num_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """bool[T]: token belongs to a live sequence (``cu`` from ``prepare_metadata``)."""
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    return (t >= cu[0]) & (t < cu[num_seqs])


def prepare_metadata(
    kv_lens: Any,  # i32[S]
    page_indices: Any,  # i32[S, pages_per_seq]
    cu_q_lens: Any,  # i32[S+1]
    num_seqs: Any,  # i32[] or i32[1]
    max_seqs: int,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # kv_lens, page_indices, cu, n: i32
    """The metadata as int32 arrays, ``num_seqs`` as a scalar clipped to ``[0, S]`` and
    ``cu_q_lens`` with every dead sequence made empty."""
    n = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(()), 0, max_seqs)
    cu = _live_cu(jnp.asarray(cu_q_lens, jnp.int32), n)
    return jnp.asarray(kv_lens, jnp.int32), jnp.asarray(page_indices, jnp.int32), cu, n
