"""Simulator-only baselines: MuxWise-like SM sharing and DistServe-like disaggregation."""

import random

import pytest

from conflux_jax.latency import Affine, LatencyModel
from conflux_jax.latency.roofline import roofline_model
from conflux_jax.scheduler.request import Request
from conflux_jax.sim.baselines import MuxLatency, simulate_disaggregated
from conflux_jax.sim.policies import POLICIES, SLOS, InstanceSpec, run_policy


def test_mux_is_monotone_and_slower_than_isolated_phases() -> None:
    base = roofline_model("qwen3-14b", "h100", sp=1, tp=4)
    mux = MuxLatency(base, tbt_slo_s=0.1)
    t_d = base.decode_path(64 * 4097)
    dec_alone = base.iteration(64, 0, 0.0, t_d)
    assert mux.iteration(64, 0, 0.0, t_d) == pytest.approx(dec_alone)
    prev = dec_alone
    for chunk in range(256, 8192, 256):
        t = mux.iteration(64 + chunk, chunk, chunk * (chunk + 1) / 2, t_d)
        assert t >= prev  # waterfill's binary search needs monotonicity
        assert t > base.iteration(chunk, chunk, chunk * (chunk + 1) / 2, 0.0)
        prev = t
    assert mux.s_min <= mux.decode_share(dec_alone) <= mux.s_max


def _model(l_per_token: float) -> LatencyModel:
    return LatencyModel(num_layers=1, num_ranks=1, gemm=Affine(l_per_token, 0.01),
                        dec=Affine(), pre=Affine(), comm=Affine())


def test_disaggregated_timeline_by_hand() -> None:
    # prefill 100 tokens: 0.01 + 100*1e-4 = 0.02 s; transfer 100 * 1e3 / 1e6 = 0.1 s;
    # then decode iterations of 0.01 + 1e-4 s each.
    def run(ttft: float):
        return simulate_disaggregated([Request(0, 0.0, 100, 3)], _model(1e-4), _model(1e-4),
                                      decode_kv_tokens=10_000, kv_bytes_per_token=1e3,
                                      ttft_slo_s=ttft, tbt_slo_s=0.05, link_bw=1e6).records[0]

    rec = run(1.0)
    assert rec.first_token_s == pytest.approx(0.02)
    assert rec.finish_s == pytest.approx(0.02 + 0.1 + 2 * 0.0101)
    assert rec.tokens == 3 and rec.compliant
    # with a 0.05 s TTFT, token 2 (due 0.10 s) lands at 0.1301 s: the KV transfer breaks it
    assert not run(0.05).compliant


def test_disaggregated_compliance_and_capacity() -> None:
    reqs = [Request(i, 0.01 * i, 50, 5) for i in range(20)]
    rep = simulate_disaggregated(reqs, _model(1e-4), _model(1e-4), decode_kv_tokens=120,
                                 kv_bytes_per_token=1.0, ttft_slo_s=1.0, tbt_slo_s=0.05)
    # the decode pool holds two requests at a time; everything still finishes
    assert all(r.finish_s is not None and r.tokens == 5 for r in rep.records)
    too_long = simulate_disaggregated([Request(0, 0.0, 500, 5)], _model(1e-4), _model(1e-4),
                                      120, 1.0, 1.0, 0.05)
    assert too_long.records[0].aborted and too_long.attainment == 0.0


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_serves_a_small_workload(policy: str) -> None:
    rng = random.Random(3)
    reqs, t = [], 0.0
    for i in range(40):
        t += rng.expovariate(2.0)
        reqs.append(Request(i, t, rng.randint(100, 4000), rng.randint(1, 50)))
    ttft, tbt = SLOS["qwen3-14b"]
    rep = run_policy(InstanceSpec(policy, "qwen3-14b", "h100", 4, ttft, tbt), reqs)
    assert all(r.finish_s is not None and r.tokens == r.output_len for r in rep.records)
    assert rep.attainment > 0.8


def test_disaggregated_skips_a_cached_prefix() -> None:
    # 100-token prompt, 60 cached: 40 tokens prefilled, 0.01 + 40*1e-4 = 0.014 s; the KV
    # moved to the decode instance is still the whole prompt's.
    rec = simulate_disaggregated([Request(0, 0.0, 100, 2, cached_prefix=60)], _model(1e-4),
                                 _model(1e-4), decode_kv_tokens=10_000,
                                 kv_bytes_per_token=1e3, ttft_slo_s=1.0, tbt_slo_s=0.05,
                                 link_bw=1e6).records[0]
    assert rec.first_token_s == pytest.approx(0.014)
    assert rec.finish_s == pytest.approx(0.014 + 0.1 + 0.0101)
