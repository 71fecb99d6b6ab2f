"""The on-device sampler against numpy brute force: filters, greedy, seeds."""

import jax.numpy as jnp
import numpy as np
import pytest

from conflux_jax.sampling import SamplingParams, sample


def _allowed(logits: np.ndarray, top_k: int, top_p: float) -> set[int]:
    """Brute force: the tokens top-k then top-p filtering keeps."""
    order = np.argsort(-logits, kind="stable")
    keep = order[: top_k if top_k > 0 else len(order)]
    probs = np.exp(logits[keep] - logits[keep].max())
    probs /= probs.sum()
    kept, mass = [], 0.0
    for tok, p in zip(keep, probs, strict=True):
        if mass >= top_p:
            break
        kept.append(int(tok))
        mass += p
    return set(kept)


def _run(logits, temperature, top_k, top_p, seed, step, n_top=0):
    s = logits.shape[0]
    return sample(jnp.asarray(logits, jnp.float32), jnp.full(s, temperature, jnp.float32),
                  jnp.full(s, top_k, jnp.int32), jnp.full(s, top_p, jnp.float32),
                  jnp.full(s, seed, jnp.uint32), jnp.full(s, step, jnp.int32), n_top)


def test_greedy_is_argmax_and_logprob_is_log_softmax():
    logits = np.random.default_rng(0).standard_normal((5, 50)).astype(np.float32)
    tokens, lps, top_ids, top_lps = _run(logits, 0.0, 0, 1.0, 1, 0, n_top=3)
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lps), ref[np.arange(5), logits.argmax(-1)], atol=1e-5)
    np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-ref, axis=-1)[:, :3])
    np.testing.assert_allclose(np.asarray(top_lps), -np.sort(-ref, axis=-1)[:, :3], atol=1e-5)


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (5, 0.7), (1, 1.0)])
def test_filtered_samples_stay_in_the_brute_force_set(top_k, top_p):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((1, 20)).astype(np.float32) * 2
    allowed = _allowed(logits[0], top_k, top_p)
    rows = np.repeat(logits, 256, axis=0)
    seen = set()
    for seed in range(4):
        tokens = np.asarray(_run(rows, 1.0, top_k, top_p, seed, 0)[0])
        # Different rows share a seed and step, so they draw the same token: vary steps.
        tokens = np.asarray(sample(
            jnp.asarray(rows), jnp.ones(256), jnp.full(256, top_k, jnp.int32),
            jnp.full(256, top_p, jnp.float32), jnp.full(256, seed, jnp.uint32),
            jnp.arange(256, dtype=jnp.int32))[0])
        seen |= set(tokens.tolist())
    assert seen <= allowed
    assert len(seen) == len(allowed)  # 1024 draws reach every kept token here


def test_unfiltered_sampling_matches_softmax_frequencies():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    n = 4000
    tokens = np.asarray(sample(
        jnp.asarray(np.repeat(logits, n, 0)), jnp.ones(n), jnp.zeros(n, jnp.int32),
        jnp.ones(n), jnp.full(n, 7, jnp.uint32), jnp.arange(n, dtype=jnp.int32))[0])
    freq = np.bincount(tokens, minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)


def test_same_seed_and_step_reproduce_and_differ_across_seeds():
    logits = np.zeros((1, 1000), np.float32)
    a = [int(_run(logits, 1.0, 0, 1.0, 42, i)[0][0]) for i in range(8)]
    b = [int(_run(logits, 1.0, 0, 1.0, 42, i)[0][0]) for i in range(8)]
    c = [int(_run(logits, 1.0, 0, 1.0, 43, i)[0][0]) for i in range(8)]
    assert a == b
    assert a != c


@pytest.mark.parametrize("kwargs,message", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"logprobs": 99}, "logprobs")])
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
