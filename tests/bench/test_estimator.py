"""``bench estimator``: refitting recorded CPU-mesh timings reproduces the shipped model."""

import dataclasses
import json
from pathlib import Path

import jax
import numpy as np
import pytest
from tiny_models import TINY_LLAMA

from conflux_jax.bench.estimator import _load_samples, main
from conflux_jax.engine.profiler import ProfileSpace, profile, random_plan, release
from conflux_jax.executor.buckets import BucketConfig
from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
from conflux_jax.latency import BatchShape, LatencyModel, coeffs_path, fit, mape
from conflux_jax.models.decoder import random_params
from conflux_jax.scheduler.block_manager import BlockManager

RECORDED = Path(__file__).resolve().parents[2] / "bench" / "results" / "estimator_sp4.json"


def _split(recorded: dict) -> tuple[list, list]:
    train, test, _ = _load_samples(RECORDED)
    assert len(test) == recorded["num_test"]
    return train, test


def test_refit_of_recorded_sp4_timings_reproduces_the_report(tmp_path, capsys):
    out, report = tmp_path / "coeffs.json", tmp_path / "report.json"
    assert main(["--from-samples", str(RECORDED), "--out", str(out),
                 "--json", str(report)]) == 0
    assert "held-out (200 random heterogeneous batches)" in capsys.readouterr().out
    got, recorded = json.loads(report.read_text()), json.loads(RECORDED.read_text())
    assert got["num_test"] == 200
    assert got["test_mape_pct"] == pytest.approx(recorded["test_mape_pct"], rel=1e-6)
    fitted = LatencyModel.load(out)
    # The executor facts matter: the paper's form (no buckets, max over ranks) fitted to
    # the same timings misses by far more.
    train, test = _split(recorded)
    plain = fit(train, fitted.num_layers, fitted.num_ranks)
    assert mape(plain, test) > 2 * got["test_mape_pct"]
    assert fitted.shared_cores and fitted.token_buckets == (16, 64, 256)
    # The engine's shipped coefficients are this fit.
    shipped = LatencyModel.load(coeffs_path("smollm2-135m", "cpu", 4, 1))
    assert shipped.gemm_per_bucket == pytest.approx(fitted.gemm_per_bucket, rel=1e-6)
    assert (shipped.alpha, shipped.beta) == (fitted.alpha, fitted.beta)
    assert shipped.dec.a == pytest.approx(fitted.dec.a, rel=1e-6)


def test_nothing_to_do_is_a_usage_error():
    with pytest.raises(SystemExit):
        main([])


@pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")
def test_profile_times_every_batch_once_per_round_and_frees_everything():
    buckets = BucketConfig(tokens=(16, 64), decode=(16,), max_prefill_seqs=2)
    ec = ExecutorConfig(mesh="sp=4,tp=1", page_size=4, num_pages=128, max_model_len=80,
                        buckets=buckets)
    ex = JaxExecutor(TINY_LLAMA, random_params(TINY_LLAMA), ec)
    runs = []
    real_run = ex.execute
    ex.execute = lambda plan: runs.append(plan) or real_run(plan)
    bm = BlockManager(4, ec.num_pages, ec.page_size)
    space = ProfileSpace(max_context=64, max_chunk=32, max_decodes=2,
                         tokens_per_rank=buckets.max_tokens, vocab=TINY_LLAMA.vocab_size)
    train, test = profile(ex, space, num_train=4, num_test=3, repeats=3, seed=7,
                          progress=False, blocks=bm)
    assert (len(train), len(test)) == (4, 3)
    # One untimed first run per batch, then one timed run per round; each round re-creates
    # the same batch from its own seed.
    assert len(runs) == 7 * (1 + 3)
    # Rounds 2 and 3 ran the very same batches (page ids are the allocator's business).
    assert [_batch(p) for p in runs[7 + 7:7 + 14]] == [_batch(p) for p in runs[7 + 14:]]
    assert not bm.requests and all(bm.used_pages(r) == 0 for r in range(4))
    # The recorded shapes are the batches drawn from each job's seed.
    order = np.random.default_rng(7).permutation(7)
    kinds = [("decode", "prefill", "mixed")[i % 3] for i in range(4)] + \
        ["mixed" if i % 2 else ("decode", "prefill", "mixed")[i % 3] for i in range(3)]
    jobs = [kinds[i] for i in order]
    want = []
    for j, kind in enumerate(jobs):
        plan = random_plan(np.random.default_rng([7, j]), kind, 4, space, bm)
        want.append((order[j] < 4, BatchShape.from_plan(plan, 4)))
        release(bm, plan)
    assert [s.shape for s in train] == [shape for is_train, shape in want if is_train]
    assert [s.shape for s in test] == [shape for is_train, shape in want if not is_train]
    assert all(s.seconds > 0 for s in train + test)


def _batch(plan):
    """A plan without its page ids: what was computed, not where its KV went."""
    return dataclasses.replace(
        plan, prefill=tuple(dataclasses.replace(p, pages=(), decode_pages=())
                            for p in plan.prefill),
        decode=tuple(d._replace(pages=()) for d in plan.decode))
