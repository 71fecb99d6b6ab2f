"""The dense reference: cached generation agrees with full recomputation."""

import jax.numpy as jnp
import numpy as np
import pytest
from tiny_models import TINY_LLAMA, TINY_QWEN3, TINY_SMOL

from conflux_jax import reference
from conflux_jax.models.decoder import random_params
from conflux_jax.sampling import SamplingParams


@pytest.mark.parametrize("config", [TINY_LLAMA, TINY_QWEN3, TINY_SMOL],
                         ids=["llama", "qwen3", "smol"])
def test_cached_greedy_generation_equals_recomputed_argmax(config):
    params = random_params(config, seed=3, scale=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, config.vocab_size, n).tolist() for n in (5, 17, 1)]
    outs: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    budgets = [6, 4, 9]

    def on_token(row, token, logprob, top):
        outs[row].append(token)
        return len(outs[row]) >= budgets[row]

    gen = reference.ReferenceGenerator(config, params)
    first_logits = gen.generate(prompts, [SamplingParams(temperature=0)] * 3, on_token)
    for i, p in enumerate(prompts):
        full = p + outs[i]
        logits = np.asarray(reference.forward(config, params, full))
        np.testing.assert_allclose(first_logits[i], logits[len(p) - 1], atol=1e-4, rtol=1e-4)
        # Every generated token is the argmax of the full forward at its position.
        expect = logits[len(p) - 1: len(full) - 1].argmax(-1)
        np.testing.assert_array_equal(outs[i], expect)


def test_dense_attention_matches_numpy_softmax():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 5, 4, 8)).astype(np.float32)
    k = rng.standard_normal((1, 7, 2, 8)).astype(np.float32)
    v = rng.standard_normal((1, 7, 2, 8)).astype(np.float32)
    pos = np.array([[2, 3, 4, 5, 6]], np.int32)
    out = np.asarray(reference.dense_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                               jnp.asarray(pos)))
    for t in range(5):
        for h in range(4):
            s = q[0, t, h] @ k[0, : pos[0, t] + 1, h // 2].T / np.sqrt(8)
            p = np.exp(s - s.max())
            p /= p.sum()
            np.testing.assert_allclose(out[0, t, h], p @ v[0, : pos[0, t] + 1, h // 2],
                                       atol=1e-5)


def test_prompt_filling_the_context_is_rejected():
    gen = reference.ReferenceGenerator(TINY_LLAMA, random_params(TINY_LLAMA))
    with pytest.raises(ValueError, match="no room"):
        gen.generate([[1] * 512], [SamplingParams()], lambda *a: True, max_model_len=512)
