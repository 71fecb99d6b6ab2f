"""A decode-only step with the same decodes as the last one updates the last host batch
in place (``JaxExecutor.build_batch``); oracle: the batch built from nothing for the same
plan, array for array, over a serving run whose decodes gain pages and end."""

import jax
import numpy as np
import pytest
from tiny_models import TINY_LLAMA

from conflux_jax.engine import Engine, EngineConfig
from conflux_jax.executor.buckets import BucketConfig
from conflux_jax.executor.jax_executor import ExecutorConfig
from conflux_jax.models.decoder import random_params
from conflux_jax.sampling import SamplingParams
from conflux_jax.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")


def _engine(mesh: str) -> Engine:
    """A tiny engine with small buckets: prefill chunks, several prompts and padding."""
    ec = ExecutorConfig(mesh=mesh, page_size=4, num_pages=96, max_model_len=128,
                        buckets=BucketConfig(tokens=(8, 32), decode=(8,), max_prefill_seqs=4))
    return Engine(TINY_LLAMA, random_params(TINY_LLAMA, seed=3, scale=0.2),
                  Tokenizer.word_level(TINY_LLAMA.vocab_size), EngineConfig(executor=ec))


def test_a_batch_updated_in_place_equals_one_built_from_nothing():
    engine = _engine("sp=4,tp=1")
    ex = engine.executor
    real = ex.build_batch
    counts = {"in_place": 0, "checked": 0}
    last: list = [None]

    def checked(plan):
        shape, batch, rows = real(plan)
        got = jax.tree.map(np.copy, batch)
        counts["in_place"] += batch is last[0]
        last[0] = batch
        kept, ex._steady = ex._steady, None  # the same plan, from nothing
        want_shape, want, want_rows = real(plan)
        ex._steady = kept
        assert (shape, rows) == (want_shape, want_rows)
        for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            if isinstance(y, np.ndarray):  # the device-resident padding is shared
                np.testing.assert_array_equal(x, y)
        counts["checked"] += 1
        return shape, batch, rows

    ex.build_batch = checked
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, TINY_LLAMA.vocab_size, int(n)).tolist()
               for n in rng.integers(3, 20, 6)]
    engine.generate(prompts, [SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True)
                              for m in rng.integers(6, 30, 6)])
    assert counts["in_place"] > 10 and counts["checked"] > counts["in_place"]


def test_one_rank_puts_prefill_tokens_in_kernel_order():
    """On one rank the step skips the kernel-order gathers of the prefill slice (and of its
    attention's output): every batch's permutation must be the identity there, over steps
    with several prompts, chunked ones and padding."""
    engine = _engine("sp=1,tp=1")
    ex = engine.executor
    real = ex.build_batch
    seen = {"prefill": 0, "several": 0}

    def checked(plan):
        shape, batch, rows = real(plan)
        if shape.prefill:
            seen["prefill"] += 1
            seen["several"] += len(plan.prefill) > 1
            identity = np.arange(shape.prefill)
            np.testing.assert_array_equal(batch.shared.perm, identity)
            np.testing.assert_array_equal(batch.shared.inverse, identity)
        return shape, batch, rows

    ex.build_batch = checked
    rng = np.random.default_rng(8)
    prompts = [rng.integers(3, TINY_LLAMA.vocab_size, int(n)).tolist()
               for n in rng.integers(3, 60, 8)]
    engine.generate(prompts, [SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
                              for _ in prompts])
    assert seen["prefill"] >= 3 and seen["several"] >= 1


def test_live_row_counts_cover_exactly_the_rows_in_use():
    """``num_rows`` / ``num_sample`` (what the packed GEMM multiplies; the rest is padding it
    skips) against the plan itself on 4 ranks: the rank's prefill tokens plus its decode
    and local-prefill rows, and its sampled rows; every row the step reads lies below them."""
    engine = _engine("sp=4,tp=1")
    ex = engine.executor
    real = ex.build_batch
    seen = {"padded": 0, "mixed": 0}

    def checked(plan):
        shape, batch, rows = real(plan)
        a = batch.rank
        for r in range(4):
            prefill = sum(p.counts[r] for p in plan.prefill)
            decodes = sum(d.rank == r for d in plan.decode) + sum(
                lp.length for lp in plan.local_prefill if lp.rank == r)
            sampled = sum(rank == r for rank, _ in rows.values())
            assert a.num_rows[r] == prefill + decodes and a.num_sample[r] == sampled
            assert (a.decode_index[r, :decodes] < a.num_rows[r]).all()
            assert (a.sample_index[r, :sampled] < a.num_rows[r]).all()
            seen["padded"] += int(a.num_rows[r]) < shape.tokens
        seen["mixed"] += bool(plan.prefill and plan.decode)
        return shape, batch, rows

    ex.build_batch = checked
    rng = np.random.default_rng(11)
    prompts = [rng.integers(3, TINY_LLAMA.vocab_size, int(n)).tolist()
               for n in rng.integers(3, 60, 8)]
    engine.generate(prompts, [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
                              for _ in prompts])
    assert seen["padded"] >= 10 and seen["mixed"] >= 1
