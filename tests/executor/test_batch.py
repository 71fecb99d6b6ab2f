"""The step's device boundary: packed inputs and outputs come back exactly as they went in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from conflux_jax.executor.batch import (
    BatchLayout,
    Packed,
    PackedSample,
    SampledRows,
    StepBatch,
    pack_forward,
)
from conflux_jax.executor.buckets import StepShape
from conflux_jax.executor.mesh import SP

LAYOUT = BatchLayout(num_ranks=4, max_prefill_seqs=3, prefill_pages_per_seq=5, num_pages=40,
                     vocab=97, mask_words=4, history_len=9, bias_width=2)
SHAPE = StepShape(tokens=16, prefill=8, decode=4, decode_pages=6, transfer=2)


def _filled(seed: int = 0) -> StepBatch:
    """A host batch with every leaf random (floats, ints and uint32 alike)."""
    rng = np.random.default_rng(seed)
    batch = StepBatch.padding(SHAPE, LAYOUT)

    def fill(a: np.ndarray) -> np.ndarray:
        if a.dtype == np.float32:
            return rng.standard_normal(a.shape).astype(np.float32)
        return rng.integers(0, 2**31 - 1, a.shape).astype(a.dtype)

    return jax.tree.map(fill, batch)


def _assert_same(got, want) -> None:
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def test_forward_inputs_round_trip_through_the_compiled_unpack() -> None:
    host = _filled()
    rank, shared = pack_forward(host)
    assert rank.buf.shape[0] == LAYOUT.num_ranks and shared.buf.ndim == 1
    got_rank, got_shared = jax.jit(lambda r, s: (r.unpack(), s.unpack()))(rank, shared)
    _assert_same(got_rank, host.rank)
    _assert_same(got_shared, host.shared)


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")
def test_per_rank_buffer_unpacks_to_each_ranks_own_rows_inside_shard_map() -> None:
    """Under shard_map each device gets its rank's row of the buffer (leading axis 1)."""
    host = _filled(1)
    mesh = jax.make_mesh((4,), (SP,))
    rank = Packed.pack(host.rank, per_rank=True)
    rank = jax.device_put(rank, NamedSharding(mesh, P(SP)))

    def body(packed: Packed) -> jax.Array:
        r = packed.unpack()
        return r.tokens + r.decode_pages.sum(axis=(1, 2))[:, None]

    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(SP), out_specs=P(SP)))(rank)
    want = host.rank.tokens + host.rank.decode_pages.sum(axis=(1, 2), dtype=np.int32)[:, None]
    np.testing.assert_array_equal(np.asarray(out), want)


def test_sample_rows_pack_their_small_fields_and_pass_the_large_ones() -> None:
    host = _filled(2).sample
    packed = PackedSample.pack(host)
    assert packed.bitmask is host.bitmask and packed.history is host.history
    _assert_same(jax.jit(lambda p: p.unpack())(packed), host)


def test_sampled_rows_come_back_bit_exact() -> None:
    rng = np.random.default_rng(3)
    rows = SampledRows(
        tokens=jnp.asarray(rng.integers(0, 1000, (4, 5)), jnp.int32),
        logprobs=jnp.asarray(-rng.random((4, 5)), jnp.float32),
        top_ids=jnp.asarray(rng.integers(0, 1000, (4, 5, 3)), jnp.int32),
        top_logprobs=jnp.asarray(-rng.random((4, 5, 3)), jnp.float32))
    buf = np.asarray(jax.jit(SampledRows.pack)(rows))
    assert buf.shape == (4, 5, 2 + 2 * 3) and buf.dtype == np.int32
    got = SampledRows.from_packed(buf)
    for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(got, name), np.asarray(getattr(rows, name)))


def test_only_four_byte_dtypes_pack() -> None:
    with pytest.raises(TypeError, match="4-byte"):
        Packed.pack({"a": np.zeros(3, np.int64)}, per_rank=False)
