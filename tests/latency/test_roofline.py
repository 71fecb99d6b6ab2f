"""Roofline coefficients against SIMULATOR.md's sanity numbers (Qwen3-14B, one H100)."""

import dataclasses

import pytest

from conflux_jax.latency import BatchShape
from conflux_jax.latency.roofline import MODELS, kv_tokens_per_rank, roofline_model


def _shape(prefill: int, decodes: int, ctx: int) -> BatchShape:
    return BatchShape((prefill,), (decodes,), (decodes * (ctx + 1),),
                      prefill * (prefill + 1) / 2)


@pytest.mark.parametrize(("prefill", "decodes", "want_s"), [
    (0, 16, 0.0185),     # 16 decodes x 8K context ~ 18.5 ms
    (32768, 0, 1.9),     # a 32K prefill alone ~ 1.9 s
    (1024, 16, 0.046),   # + 1K prefill ~ 46 ms (<= 50 ms)
    (2200, 16, 0.091),   # + 2.2K prefill ~ 91 ms (<= 100 ms)
])
def test_sanity_numbers(prefill: int, decodes: int, want_s: float) -> None:
    m = roofline_model("qwen3-14b", "h100", sp=1)
    assert m.estimate(_shape(prefill, decodes, 8192)) == pytest.approx(want_s, rel=0.06)


def test_params_match_model_table() -> None:
    assert MODELS["llama3.1-8b"].params_per_layer == pytest.approx(218.1e6, rel=1e-3)
    assert MODELS["qwen3-14b"].params_per_layer == pytest.approx(330.3e6, rel=1e-3)
    assert MODELS["qwen3-32b"].params_per_layer == pytest.approx(487.6e6, rel=1e-3)
    assert MODELS["qwen3-32b"].total_params == pytest.approx(32.76e9, rel=1e-2)
    assert MODELS["qwen3-14b"].kv_bytes_per_token_layer * 40 == 160 * 1024


def test_h200_decodes_faster_and_sp_splits_prefill() -> None:
    dec = _shape(0, 64, 8192)
    h100, h200 = roofline_model("qwen3-14b", "h100", 1), roofline_model("qwen3-14b", "h200", 1)
    assert h200.estimate(dec) < h100.estimate(dec)
    sp4 = roofline_model("qwen3-14b", "h100", sp=4)
    one = h100.estimate(_shape(32768, 0, 0))
    four = sp4.estimate(BatchShape((8192,) * 4, (0,) * 4, (0,) * 4, 32768 * 32769 / 2))
    assert one / 4 < four < one / 3.5  # near-linear SP scaling plus all-to-all cost


def test_tp_and_kv_capacity() -> None:
    tp2 = roofline_model("qwen3-32b", "h100", sp=4, tp=2)
    assert tp2.meta == {"model": "qwen3-32b", "hardware": "h100", "sp": 4, "tp": 2,
                        "source": "roofline", "attention": "serial"}
    assert 200_000 < kv_tokens_per_rank("qwen3-14b", "h100") < 300_000
    with pytest.raises(ValueError):
        roofline_model("qwen3-14b", "h100", sp=16)  # more SP ranks than KV heads


def test_kv_transfer_is_bytes_over_link_bandwidth() -> None:
    """T_X per layer = the KV bytes leaving other ranks / the link bandwidth (+ the
    collective's floor); one rank moves nothing."""
    from conflux_jax.latency.roofline import A2A_BW, A2A_FLOOR_S

    m = MODELS["llama3.1-8b"]
    sp4 = roofline_model("llama3.1-8b", "h200", sp=4)
    tokens = 65536
    moved = tokens * m.kv_bytes_per_token_layer * 3 / 4  # the decode rank holds 1/4
    assert sp4.transfer_path(tokens) == pytest.approx(moved / A2A_BW + A2A_FLOOR_S)
    plain = BatchShape((4096,) * 4, (0,) * 4, (0,) * 4, 4096.0 * 4096)
    done = BatchShape(plain.n_p, plain.n_d, plain.w_d, plain.a_p, x_kv=tokens)
    assert sp4.estimate(done) - sp4.estimate(plain) == pytest.approx(
        m.num_layers * sp4.transfer_path(tokens))
    sp1 = roofline_model("llama3.1-8b", "h200", sp=1)
    one = BatchShape((4096,), (0,), (0,), 4096.0 * 4096)
    assert sp1.estimate(dataclasses.replace(one, x_kv=tokens)) == sp1.estimate(one)
