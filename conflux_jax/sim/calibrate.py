"""Each policy's estimate, fitted to profiles of the simulated truth (issue 17).

The simulated executor's clock is the *truth*: the roofline of the design (or a fitted
machine model given with ``--coeffs``) plus per-iteration noise. A scheduler never sees
it. Like the engine, which fits its latency model to timings of its own executor, each
policy's scheduler gets a model fitted by :func:`conflux_jax.latency.fit` to what
:func:`conflux_jax.engine.profiler.profile` measured on the truth, with the engine's sample
budget and statistic. The fitted form (the paper's Eqs. 2-6: affine pieces, max-overlap
attention) is not the truth's form (weight-read floors, serialized attention, noise), so
the estimate errs the way a real one does; how much is reported, never assumed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy as np

from conflux_jax.engine.profiler import PROFILE_BUDGET, ProfileSpace, profile, reported_time
from conflux_jax.latency import BatchShape, LatencyModel, ProfileSample, fit, mape
from conflux_jax.plan import KVSpec
from conflux_jax.sim.executor import SimExecutor


@dataclasses.dataclass(frozen=True)
class Estimate:
    model: LatencyModel  # what the scheduler plans with
    report: dict[str, Any]  # how it was made and how far it is from the truth


def sim_space(max_context: int, tokens_per_rank: int) -> ProfileSpace:
    """The batches a GPU engine would profile at warm-up: contexts up to its model length,
    chunks up to its token buffer, up to 64 resident decodes per rank."""
    return ProfileSpace(max_context=max_context, max_chunk=tokens_per_rank, max_decodes=64,
                        tokens_per_rank=tokens_per_rank)


def _error_vs_truth(est: LatencyModel, truth: LatencyModel,
                    shapes: list[BatchShape]) -> float:
    """MAPE (%) of the estimate against the noise-free truth on ``shapes``."""
    return mape(est, [ProfileSample(s, truth.estimate(s)) for s in shapes])


@functools.lru_cache(maxsize=64)
def fitted_estimate(truth: LatencyModel, space: ProfileSpace, noise: float = 0.0,
                    seed: int = 0) -> Estimate:
    """The latency model a scheduler fits to profiles of ``truth`` under ``noise``."""
    ex = SimExecutor(truth, KVSpec(truth.num_ranks, 1, 1), noise=noise, seed=seed)
    budget = PROFILE_BUDGET
    train, test = profile(ex, space, budget["num_train"], budget["num_test"],
                          budget["repeats"], seed, timer=reported_time,
                          statistic=budget["statistic"], progress=False)
    est = fit(train, truth.num_layers, truth.num_ranks,
              meta={**truth.meta, "fitted_to": "simulated truth", "noise": noise},
              token_buckets=truth.token_buckets, shared_cores=truth.shared_cores)
    shapes = [s.shape for s in test]
    bias = float(np.mean([est.estimate(s) / truth.estimate(s) - 1.0 for s in shapes]))
    return Estimate(est, {
        "source": "fitted", "truth_noise": noise, **budget,
        "train_mape_pct": mape(est, train), "test_mape_pct": mape(est, test),
        "test_mape_vs_truth_pct": _error_vs_truth(est, truth, shapes),
        "mean_bias_pct": 100.0 * bias})


def oracle_estimate(truth: LatencyModel, noise: float = 0.0) -> Estimate:
    """The truth itself as the estimate (the simulator's old, self-grading setting)."""
    return Estimate(truth, {"source": "truth (oracle)", "truth_noise": noise})
