"""vLLM-style serving metrics and the per-token deadline attainment."""

import pytest

from conflux_jax.bench.metrics import RequestResult, format_summary, summarize


def _req(send, times, ok=True):
    return RequestResult(send, 10, list(times), len(times), ok)


def test_summary_keys_and_deadlines() -> None:
    rs = [_req(0.0, [0.5, 0.6, 0.7]),     # meets 1 s / 0.2 s
          _req(0.0, [0.9, 1.5]),          # 2nd token due by 1.2: late
          _req(1.0, [], ok=False)]        # failed counts as late
    m = summarize(rs, duration_s=2.0, ttft_slo_s=1.0, tbt_slo_s=0.2)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_output_tokens"] == 5
    assert m["deadline_attainment"] == pytest.approx(1 / 3)
    assert m["mean_ttft_ms"] == pytest.approx(700.0)
    assert m["mean_tpot_ms"] == pytest.approx((100.0 + 600.0) / 2)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["request_goodput"] == pytest.approx(0.5)
    for k in ("duration", "request_throughput", "output_throughput", "total_token_throughput",
              "p99_ttft_ms", "std_itl_ms", "input_lens", "output_lens", "ttfts", "itls"):
        assert k in m
    text = format_summary(m)
    assert "Serving Benchmark Result" in text and "Mean TTFT (ms):" in text
    assert "Deadline attainment (1s/200ms):" in text
