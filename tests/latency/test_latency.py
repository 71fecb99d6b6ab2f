"""Latency model: evaluation rules, JSON round trip, least-squares fit and MAPE."""

import dataclasses
import random

import pytest

from conflux_jax.latency import (
    Affine,
    BatchShape,
    LatencyModel,
    ProfileSample,
    fit,
    mape,
)

TRUE = LatencyModel(num_layers=4, num_ranks=4, gemm=Affine(2e-6, 1e-4), dec=Affine(3e-8, 2e-5),
                    pre=Affine(5e-10, 3e-5), comm=Affine(1e-7, 4e-5), alpha=1.25, beta=1.1)


def _random_shape(rng: random.Random, kind: str, n: int = 4) -> BatchShape:
    n_p = [0] * n
    n_d = [0] * n
    w_d = [0] * n
    a_p = 0.0
    if kind in ("prefill", "mixed"):
        length, ctx = rng.randint(32, 10_000), rng.choice([0, rng.randint(0, 16_000)])
        base, extra = divmod(length, n)
        n_p = [base + (r < extra) for r in range(n)]
        a_p = length * (ctx + (length + 1) / 2)
    if kind in ("decode", "mixed"):
        for _ in range(rng.randint(1, 128)):
            r = rng.randrange(n)
            n_d[r] += 1
            w_d[r] += rng.randint(1_000, 16_000)
    return BatchShape(tuple(n_p), tuple(n_d), tuple(w_d), a_p)


def _samples(rng: random.Random, model: LatencyModel, count: int) -> list[ProfileSample]:
    kinds = ["prefill", "decode", "mixed", "mixed"]
    return [ProfileSample(s, model.estimate(s))
            for s in (_random_shape(rng, kinds[i % 4]) for i in range(count))]


def test_empty_components_cost_nothing() -> None:
    assert TRUE.estimate(BatchShape((0,) * 4, (0,) * 4, (0,) * 4, 0.0)) == 0.0
    dec_only = BatchShape((0,) * 4, (2, 0, 0, 0), (100, 0, 0, 0), 0.0)
    want = 4 * (TRUE.gemm(2) + TRUE.dec(100))
    assert TRUE.estimate(dec_only) == pytest.approx(want)


def test_contention_applies_only_to_mixed_batches() -> None:
    pre_only = BatchShape((10, 10, 10, 10), (0,) * 4, (0,) * 4, 40 * 20.5)
    t_p = TRUE.comm(10) + TRUE.pre(40 * 20.5 / 4)
    assert TRUE.estimate(pre_only) == pytest.approx(4 * (TRUE.gemm(10) + t_p))
    mixed = BatchShape((10, 10, 10, 10), (1, 0, 0, 0), (5000, 0, 0, 0), 40 * 20.5)
    attn = max(TRUE.beta * t_p, TRUE.alpha * TRUE.dec(5000))
    assert TRUE.estimate(mixed) == pytest.approx(4 * (TRUE.gemm(11) + attn))


def test_critical_rank_and_path() -> None:
    # The max over ranks decides, not the sum: moving decode context between ranks
    # changes the estimate only through the heaviest rank.
    a = BatchShape((0,) * 4, (1, 1, 0, 0), (8000, 8000, 0, 0), 0.0)
    b = BatchShape((0,) * 4, (2, 0, 0, 0), (16000, 0, 0, 0), 0.0)
    assert TRUE.estimate(b) > TRUE.estimate(a)


def test_json_round_trip(tmp_path) -> None:
    path = tmp_path / "c.json"
    TRUE.save(path)
    assert LatencyModel.load(path) == TRUE


def test_fit_recovers_model_from_iteration_samples() -> None:
    rng = random.Random(0)
    train, held_out = _samples(rng, TRUE, 200), _samples(rng, TRUE, 200)
    fitted = fit(train, num_layers=4, num_ranks=4, meta={"model": "toy"})
    assert mape(fitted, held_out) < 1.0
    assert fitted.alpha == pytest.approx(TRUE.alpha, abs=0.051)
    assert fitted.meta["model"] == "toy" and fitted.meta["source"] == "profile"


def test_fit_recovers_the_kv_transfer_term() -> None:
    """Completing prefills move their prompt's KV to a decode rank (T_X): the fit learns
    its slope and intercept from samples that carry ``x_kv``."""
    true = dataclasses.replace(TRUE, transfer=Affine(4e-8, 3e-5))
    rng = random.Random(2)

    def with_transfer(count: int) -> list[ProfileSample]:
        out = []
        for smp in _samples(rng, true, count):
            moved = rng.choice([0, rng.randint(100, 20_000)]) if smp.shape.a_p else 0
            shape = dataclasses.replace(smp.shape, x_kv=moved)
            out.append(ProfileSample(shape, true.estimate(shape)))
        return out

    train, held_out = with_transfer(200), with_transfer(200)
    fitted = fit(train, num_layers=4, num_ranks=4)
    assert mape(fitted, held_out) < 1.0
    assert fitted.transfer.a == pytest.approx(4e-8, rel=0.05)
    assert fitted.transfer.b == pytest.approx(3e-5, rel=0.2)
    one_rank = fit([ProfileSample(dataclasses.replace(s.shape, n_p=(sum(s.shape.n_p),),
                                                      n_d=(sum(s.shape.n_d),),
                                                      w_d=(max(s.shape.w_d),)), s.seconds)
                    for s in train], num_layers=4, num_ranks=1)
    assert one_rank.transfer == Affine()  # nothing moves between ranks on one rank


def test_fit_with_noise_stays_accurate() -> None:
    rng = random.Random(1)
    noisy = [ProfileSample(s.shape, s.seconds * (1 + rng.gauss(0, 0.03)))
             for s in _samples(rng, TRUE, 300)]
    fitted = fit(noisy, num_layers=4, num_ranks=4)
    assert mape(fitted, _samples(rng, TRUE, 200)) < 5.0


def test_mape_of_exact_model_is_zero() -> None:
    assert mape(TRUE, _samples(random.Random(2), TRUE, 20)) == pytest.approx(0.0)


# ---- executor facts: token buckets, ranks that share cores ------------------------------
BUCKETED = LatencyModel(num_layers=4, num_ranks=4, gemm=Affine(2e-6, 1e-4),
                        dec=Affine(3e-8, 2e-5), pre=Affine(5e-10, 3e-5),
                        comm=Affine(1e-7, 4e-5), alpha=1.25, beta=1.1,
                        token_buckets=(16, 64, 256, 1024, 4096), shared_cores=True)


def test_buckets_price_the_padded_shape() -> None:
    assert [BUCKETED.padded(x) for x in (0, 1, 16, 17, 64, 65, 4096, 5000)] == \
        [0, 16, 16, 64, 64, 256, 4096, 5000]
    # 17 and 64 tokens per rank run the same 64-slot executable: same GEMM and all-to-all.
    a = BatchShape((17, 0, 0, 0), (0,) * 4, (0,) * 4, 17 * 9.0)
    b = BatchShape((64, 0, 0, 0), (0,) * 4, (0,) * 4, 17 * 9.0)
    assert BUCKETED.estimate(a) == pytest.approx(BUCKETED.estimate(b))
    want = 4 * (BUCKETED.gemm(64) + BUCKETED.comm(64) + BUCKETED.pre(17 * 9.0 / 4))
    assert BUCKETED.estimate(a) == pytest.approx(want)


def test_shared_cores_add_decode_work_over_ranks() -> None:
    spread = BatchShape((0,) * 4, (1, 1, 0, 0), (8000, 8000, 0, 0), 0.0)
    one = BatchShape((0,) * 4, (2, 0, 0, 0), (16000, 0, 0, 0), 0.0)
    # Same padded buffer (16) and the same summed context: the same time on shared cores.
    assert BUCKETED.estimate(spread) == pytest.approx(BUCKETED.estimate(one))
    assert BUCKETED.decode_work([3, 4, 5]) == 12 and TRUE.decode_work([3, 4, 5]) == 5


def test_owner_alone_suffixes_price_like_the_prefill_share_they_replace() -> None:
    """T_L on dedicated devices is f_P of the busiest owner's work; on shared cores f_P was
    fitted to the 1/N share of work all ranks run on the same cores, so a suffix alone on
    one rank costs what the same work spread by Ulysses costs, without the all-to-all."""
    w = 12_000.0
    alone = BatchShape((0,) * 4, (5, 0, 0, 0), (0,) * 4, 0.0, w_l=(w, 0.0, 0.0, 0.0))
    none = BatchShape((0,) * 4, (5, 0, 0, 0), (0,) * 4, 0.0)
    assert TRUE.estimate(alone) - TRUE.estimate(none) == pytest.approx(4 * TRUE.pre(w))
    assert TRUE.local_path([w, 2 * w]) == pytest.approx(TRUE.pre(2 * w))
    assert BUCKETED.local_path([w, 2 * w]) == pytest.approx(BUCKETED.pre(3 * w / 4))
    assert BUCKETED.local_path([w, 0, 0, 0]) == pytest.approx(BUCKETED.prefill_path(1, w)
                                                             - BUCKETED.comm(16))
    assert TRUE.local_path(()) == 0.0


def test_bucketed_json_round_trip_and_fit(tmp_path) -> None:
    BUCKETED.save(tmp_path / "b.json")
    assert LatencyModel.load(tmp_path / "b.json") == BUCKETED
    rng = random.Random(3)
    train, held_out = _samples(rng, BUCKETED, 200), _samples(rng, BUCKETED, 200)
    fitted = fit(train, num_layers=4, num_ranks=4, token_buckets=BUCKETED.token_buckets,
                 shared_cores=True)
    assert fitted.token_buckets == BUCKETED.token_buckets and fitted.shared_cores
    assert mape(fitted, held_out) < 1.0
    # The unpadded, max-over-ranks form cannot describe these timings.
    assert mape(fit(train, num_layers=4, num_ranks=4), held_out) > 3 * mape(fitted, held_out)


def test_per_bucket_gemm_fit_and_repricing_for_other_buckets() -> None:
    rng = random.Random(4)
    train = _samples(rng, BUCKETED, 200)
    fitted = fit(train, num_layers=4, num_ranks=4, token_buckets=BUCKETED.token_buckets,
                 shared_cores=True)
    # One measured time per bucket (what each executable costs), equal to the truth here.
    assert fitted.gemm_per_bucket == pytest.approx(
        [BUCKETED.gemm(b) for b in BUCKETED.token_buckets], rel=1e-3)
    assert fitted.gemm_time(17) == pytest.approx(BUCKETED.gemm(64), rel=1e-3)
    # An engine with other buckets: interpolated inside the measured range, the fitted line
    # beyond it.
    other = fitted.for_buckets((32, 64, 8192))
    assert other.token_buckets == (32, 64, 8192)
    assert other.gemm_time(20) == pytest.approx(BUCKETED.gemm(32), rel=1e-3)
    assert other.gemm_time(8000) == pytest.approx(BUCKETED.gemm(8192), rel=1e-2)
    assert LatencyModel.from_dict(fitted.to_dict()) == fitted


def test_shipped_fits_load_and_price_no_transfer() -> None:
    """The shipped CPU fits do not measure T_X: they load with a zero transfer term, so a
    step that completes a prefill prices exactly as before."""
    from conflux_jax.latency.coeffs import COEFFS_DIR

    fits = sorted(COEFFS_DIR.glob("*.json"))
    assert fits
    for path in fits:
        model = LatencyModel.load(path)
        assert model.transfer == Affine()
        n = model.num_ranks
        plain = BatchShape((64,) * n, (2,) * n, (300,) * n, 64.0 * n * 65)
        done = dataclasses.replace(plain, x_kv=4096)
        assert model.estimate(done) == model.estimate(plain) > 0


def test_plan_transfer_feature_is_the_busiest_decode_rank() -> None:
    from conflux_jax.plan import IterationPlan, PrefillPiece

    pieces = (PrefillPiece(0, 100, (5, 5, 5, 5), True, 1),
              PrefillPiece(1, 0, (2, 2, 2, 2), True, 1),
              PrefillPiece(2, 0, (1, 1, 1, 1), True, 3),
              PrefillPiece(3, 0, (9, 9, 9, 9)))  # not completing: moves nothing
    shape = BatchShape.from_plan(IterationPlan(pieces, (), 0.0), 4)
    assert shape.x_kv == 120 + 8
    model = dataclasses.replace(TRUE, transfer=Affine(1e-6, 1e-5))
    assert model.estimate(shape) - TRUE.estimate(shape) == pytest.approx(
        TRUE.num_layers * (1e-5 + 128e-6))
    assert LatencyModel.from_dict(model.to_dict()) == model
