"""SLO compliance (§8.1) and goodput, against deadlines worked out by hand."""

from conflux_jax import slo


def test_token_deadlines_and_compliance():
    # arrival 1.0, TTFT 0.5, TBT 0.1: tokens due at 1.5, 1.6, 1.7, ...
    assert slo.token_deadline(1.0, 0, 0.5, 0.1) == 1.5
    assert abs(slo.token_deadline(1.0, 3, 0.5, 0.1) - 1.8) < 1e-12
    assert slo.on_time(1.5, 1.0, 0, 0.5, 0.1)  # exactly on the deadline is on time
    assert not slo.on_time(1.5001, 1.0, 0, 0.5, 0.1)
    assert slo.all_on_time([1.2, 1.6, 1.65], 1.0, 0.5, 0.1)
    assert not slo.all_on_time([1.2, 1.6, 1.75], 1.0, 0.5, 0.1)  # third due at 1.7
    assert slo.all_on_time([], 1.0, 0.5, 0.1)


def test_goodput_is_the_highest_rate_meeting_the_target():
    assert slo.ATTAINMENT_TARGET == 0.95
    assert slo.goodput([1, 2, 3, 4], [1.0, 0.96, 0.9, 0.97]) == 4
    assert slo.goodput([1, 2], [0.5, 0.2]) == 0.0
    assert slo.goodput([1, 2], [0.9, 0.8], target=0.85) == 1
