"""The dense-layer bound: which steps it prices, and that its layers are the model's."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import TINY_LLAMA

from conflux_jax.bench import dense_bound as db
from conflux_jax.models.decoder import BLAS_MAX_ROWS, BLAS_MIN_ROWS, Decoder, random_params


@pytest.mark.parametrize(("c", "prompt_len", "prefill_steps", "step", "decode_rows"), [
    (16, 128, 4, 512, [16]),  # 2,048 prompt tokens: four full steps
    (16, 32, 1, 512, [16]),
    (4, 100, 1, 400, [4, 16]),  # fewer tokens than a step: one step of exactly them
    (3, 200, 600 / 512, 512, [3, 16]),  # a partial step at the full step's cost per token
    (17, 8, 1, 136, [17, 32]),
])
@pytest.mark.parametrize("padded_is_faster", [False, True])
def test_bound_prices_prefill_steps_and_decode_steps(monkeypatch, c, prompt_len,
                                                     prefill_steps, step, decode_rows,
                                                     padded_is_faster):
    calls = []

    def fake_seconds(config, params, rows, lm_head, repeats=5):  # the timing, not the arithmetic
        calls.append((rows, lm_head))
        if not lm_head:
            return 0.5
        return 0.01 if (rows == c) != padded_is_faster else 0.02

    monkeypatch.setattr(db, "dense_seconds", fake_seconds)
    b = db.dense_bound(TINY_LLAMA, random_params(TINY_LLAMA), c, prompt_len, max_tokens=9)
    assert calls == [(step, False)] + [(r, True) for r in decode_rows]
    step_s = 0.01 if len(decode_rows) > 1 or not padded_is_faster else 0.02
    assert b.decode_step_s == pytest.approx(step_s)  # the faster of the row counts
    assert b.prefill_s == pytest.approx(prefill_steps * 0.5)
    assert b.decode_s == pytest.approx(8 * step_s)
    assert b.tokens_per_s == pytest.approx(c * 9 / (prefill_steps * 0.5 + 8 * step_s))


@pytest.mark.parametrize(("linears", "t"), [("xla", 5), ("blas", 5), ("blas", BLAS_MAX_ROWS + 3),
                                             ("blas", BLAS_MIN_ROWS - 1),  # XLA's dot again
                                             ("packed", 5)])
def test_dense_fn_is_the_model_with_attention_as_identity(linears, t):
    cfg, params = TINY_LLAMA, random_params(TINY_LLAMA, seed=0)
    model = Decoder.from_params(cfg, params)
    dim = cfg.hidden_size
    x = jnp.asarray(np.random.default_rng(1).standard_normal((t, dim)), jnp.float32)
    pos = jnp.arange(t, dtype=jnp.int32)
    weights = db._packed(params) if linears == "packed" else params
    got = db._dense_fn(cfg, lm_head=True, linears=linears)(weights, x, pos)
    # Oracle: the same blocks written out from the weights, attention output = q.
    w = {k: np.asarray(v) for k, v in model.layers.weights().items()}
    eps = model.config.rms_norm_eps
    inv = np.asarray(model.inv_freq[...])

    def norm(a, g):
        return g * a / np.sqrt(np.mean(a * a, -1, keepdims=True) + eps)

    def rope(q):  # q [T, H, d], rotate-half form
        ang = np.asarray(pos)[:, None] * inv[None]
        cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
        half = q.shape[-1] // 2
        rot = np.concatenate([-q[..., half:], q[..., :half]], -1)
        return q * cos[:, None] + rot * sin[:, None]

    h = np.asarray(x, np.float64)
    for i in range(cfg.num_layers):
        a = norm(h, w["attn_norm"][i])
        q = rope((a @ w["wq"][i]).reshape(t, cfg.num_heads, cfg.head_dim))
        h = h + q.reshape(t, -1) @ w["wo"][i]
        m = norm(h, w["mlp_norm"][i])
        gate = m @ w["w_gate"][i]
        h = h + (gate / (1 + np.exp(-gate)) * (m @ w["w_up"][i])) @ w["w_down"][i]
    h = norm(h, np.asarray(model.final_norm[...]))
    head = model.lm_head[...] if model.lm_head is not None else model.embed[...].T
    np.testing.assert_allclose(np.asarray(got), h @ np.asarray(head), rtol=2e-4, atol=2e-4)
