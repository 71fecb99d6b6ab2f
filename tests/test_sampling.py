"""The on-device sampler against numpy brute force: filters, greedy, seeds."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conflux_jax.sampling import (
    LogitAdjustments,
    SamplingParams,
    first_argmax,
    mask_words,
)
from conflux_jax.sampling import sample as eager_sample

# Compiled once per shape, as the step runs it: op by op, a call took seconds.
sample = jax.jit(eager_sample, static_argnames="num_top_logprobs")


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


@pytest.mark.parametrize("wanted", [[0, 0, 0, 0, 0], [0, 0, 2, 0, 0]])
def test_top_alternatives_only_when_a_row_asks_for_them(wanted):
    """With per-row ``top_logprobs``, a step where no row asks skips the top-k (zeros come
    back); one row asking gets every row's, as numpy's sort gives them."""
    logits = np.random.default_rng(1).standard_normal((5, 50)).astype(np.float32)
    s = logits.shape[0]
    jitted = jax.jit(eager_sample, static_argnums=6)
    tokens, lps, top_ids, top_lps = jitted(
        jnp.asarray(logits), jnp.zeros(s), jnp.zeros(s, jnp.int32), jnp.ones(s),
        jnp.zeros(s, jnp.uint32), jnp.zeros(s, jnp.int32), 3, None, None,
        jnp.asarray(wanted, jnp.int32))
    ref = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_array_equal(np.asarray(tokens), logits.argmax(-1))
    np.testing.assert_allclose(np.asarray(lps), ref.max(-1), atol=1e-5)
    assert top_ids.shape == top_lps.shape == (5, 3)
    if any(wanted):
        np.testing.assert_array_equal(np.asarray(top_ids), np.argsort(-ref, axis=-1)[:, :3])
        np.testing.assert_allclose(np.asarray(top_lps), -np.sort(-ref, axis=-1)[:, :3],
                                   atol=1e-5)
    else:
        assert not np.asarray(top_ids).any() and not np.asarray(top_lps).any()


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.5), (5, 0.7), (1, 1.0)])
def test_filtered_samples_stay_in_the_brute_force_set(top_k, top_p):
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((1, 20)).astype(np.float32) * 2
    allowed = _allowed(logits[0], top_k, top_p)
    rows = np.repeat(logits, 256, axis=0)
    seen = set()
    for seed in range(4):
        # Rows sharing a seed and step would draw the same token: vary steps.
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
    ({"top_p": 0.0}, "top_p"), ({"top_k": -2}, "top_k"), ({"logprobs": 99}, "logprobs"),
    ({"n": 0}, "n must"), ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty")])
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


# ---------------------------------------------------------------- mask and penalties
def np_penalize(logits: np.ndarray, prompt: list[int], output: list[int], presence: float,
                frequency: float, repetition: float) -> np.ndarray:
    """vLLM's penalties, written out: repetition over prompt + output tokens, then
    frequency per output occurrence, then presence once per output token."""
    out = logits.astype(np.float64).copy()
    seen = sorted(set(prompt) | set(output))
    out[seen] = np.where(out[seen] > 0, out[seen] / repetition, out[seen] * repetition)
    counts = np.bincount(np.asarray(output, int), minlength=len(out)) if output else \
        np.zeros(len(out))
    return out - frequency * counts - presence * (counts > 0)


def _adjust(bitmask, histories, penalties, vocab, h=32, bias=None):
    s = len(histories)
    hist = np.full((s, h), vocab, np.int32)
    num_prompt = np.zeros(s, np.int32)
    for i, (prompt, output) in enumerate(histories):
        toks = prompt + output
        hist[i, :len(toks)] = toks
        num_prompt[i] = len(prompt)
    p = np.asarray(penalties, np.float32)
    ids, values = np.full((s, 8), vocab, np.int32), np.zeros((s, 8), np.float32)
    for i, row in enumerate(bias or []):
        for j, (t, v) in enumerate(row.items()):
            ids[i, j], values[i, j] = t, v
    return LogitAdjustments(jnp.asarray(bitmask), jnp.asarray(hist), jnp.asarray(num_prompt),
                            jnp.asarray(p[:, 0]), jnp.asarray(p[:, 1]), jnp.asarray(p[:, 2]),
                            jnp.asarray(ids), jnp.asarray(values))


def test_penalties_match_the_numpy_oracle_of_vllms_semantics():
    rng = np.random.default_rng(3)
    vocab = 70
    logits = (rng.standard_normal((4, vocab)) * 3).astype(np.float32)
    histories = [([1, 2, 3, 3], [4, 4, 4, 9]), ([5], [5, 6, 6, 7, 8, 8, 8]),
                 ([10, 11], []), ([0, 69], [69, 69, 1])]
    penalties = [(0.5, 0.3, 1.3), (-0.4, 1.2, 0.7), (2.0, -2.0, 1.9), (0.0, 0.0, 1.0)]
    adj = _adjust(np.full((4, mask_words(vocab)), -1, np.int32), histories, penalties, vocab)
    got = np.asarray(adj.apply(jnp.asarray(logits)))
    for i, ((prompt, output), (pp, fp, rp)) in enumerate(zip(histories, penalties,
                                                             strict=True)):
        np.testing.assert_allclose(got[i], np_penalize(logits[i], prompt, output, pp, fp, rp),
                                   rtol=1e-5, atol=1e-5)
    # Greedy follows the adjusted logits; logprobs stay those of the raw distribution.
    s = 4
    tokens, lps, _, _ = sample(jnp.asarray(logits), jnp.zeros(s), jnp.zeros(s, jnp.int32),
                               jnp.ones(s), jnp.zeros(s, jnp.uint32), jnp.zeros(s, jnp.int32),
                               adjust=adj)
    np.testing.assert_array_equal(np.asarray(tokens), got.argmax(-1))
    raw = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(lps), raw[np.arange(s), got.argmax(-1)], atol=1e-5)


def test_bitmask_only_admits_its_tokens_greedy_and_sampled():
    rng = np.random.default_rng(4)
    vocab, s = 100, 64
    allowed = [set(rng.choice(vocab, size=k, replace=False).tolist()) for k in (1, 3, 40, 7)]
    bits = np.zeros((len(allowed), vocab), bool)
    for i, a in enumerate(allowed):
        bits[i, sorted(a)] = True
    packed = np.packbits(np.pad(bits, ((0, 0), (0, 32 * mask_words(vocab) - vocab))),
                         axis=1, bitorder="little").view(np.int32)  # llguidance's layout
    rows = np.repeat(np.arange(len(allowed)), s // len(allowed))
    logits = jnp.asarray(rng.standard_normal((s, vocab)).astype(np.float32))
    adj = _adjust(packed[rows], [([], [])] * s, [(0.0, 0.0, 1.0)] * s, vocab)
    for temperature in (0.0, 1.0):
        tokens = np.asarray(sample(logits, jnp.full(s, temperature), jnp.zeros(s, jnp.int32),
                                   jnp.ones(s), jnp.arange(s, dtype=jnp.uint32),
                                   jnp.zeros(s, jnp.int32), adjust=adj)[0])
        assert all(int(t) in allowed[r] for t, r in zip(tokens, rows, strict=True))
    greedy = np.where(bits[rows], np.asarray(logits), -np.inf).argmax(-1)
    tokens = np.asarray(sample(logits, jnp.zeros(s), jnp.zeros(s, jnp.int32), jnp.ones(s),
                               jnp.zeros(s, jnp.uint32), jnp.zeros(s, jnp.int32),
                               adjust=adj)[0])
    np.testing.assert_array_equal(tokens, greedy)


def test_logit_bias_is_added_before_the_penalties_as_in_vllm():
    rng = np.random.default_rng(5)
    vocab = 40
    logits = (rng.standard_normal((3, vocab)) * 3).astype(np.float32)
    histories = [([1, 2], [3, 3]), ([], [7]), ([4], [])]
    penalties = [(0.5, 0.3, 1.3), (0.0, 0.0, 1.0), (0.2, 0.0, 1.5)]
    bias = [{3: 2.5, 9: -7.0}, {7: 0.25}, {}]
    adj = _adjust(np.full((3, mask_words(vocab)), -1, np.int32), histories, penalties, vocab,
                  bias=bias)
    got = np.asarray(adj.apply(jnp.asarray(logits)))
    for i in range(3):
        biased = logits[i].astype(np.float64).copy()
        for t, v in bias[i].items():
            biased[t] += v
        np.testing.assert_allclose(got[i], np_penalize(biased, *histories[i], *penalties[i]),
                                   rtol=1e-5, atol=1e-5)


def test_logit_bias_flips_the_greedy_token_exactly_past_the_gap():
    logits = np.random.default_rng(6).standard_normal((2, 30)).astype(np.float32)
    first, second = np.argsort(-logits[0])[:2]
    gap = float(logits[0, first] - logits[0, second])
    bias = [{int(second): gap + 1e-3}, {int(second): gap - 1e-3}]
    adj = _adjust(np.full((2, mask_words(30)), -1, np.int32), [([], [])] * 2,
                  [(0.0, 0.0, 1.0)] * 2, 30, bias=bias)
    rows = np.repeat(logits[:1], 2, 0)
    tokens = np.asarray(sample(jnp.asarray(rows), jnp.zeros(2), jnp.zeros(2, jnp.int32),
                               jnp.ones(2), jnp.zeros(2, jnp.uint32), jnp.zeros(2, jnp.int32),
                               adjust=adj)[0])
    assert tokens.tolist() == [second, first]


@pytest.mark.parametrize("min_p,temperature", [(0.1, 1.0), (0.3, 0.7), (0.05, 2.0)])
def test_min_p_samples_stay_in_the_brute_force_set(min_p, temperature):
    """vLLM's min-p: after the temperature, keep p_i >= min_p * max_j p_j."""
    logits = (np.random.default_rng(7).standard_normal((1, 24)) * 2).astype(np.float32)
    probs = np.exp(logits[0] / temperature - (logits[0] / temperature).max())
    probs /= probs.sum()
    allowed = set(np.flatnonzero(probs >= min_p * probs.max()).tolist())
    n = 1024
    tokens = np.asarray(sample(
        jnp.asarray(np.repeat(logits, n, 0)), jnp.full(n, temperature, jnp.float32),
        jnp.zeros(n, jnp.int32), jnp.ones(n), jnp.full(n, 3, jnp.uint32),
        jnp.arange(n, dtype=jnp.int32), min_p=jnp.full(n, min_p, jnp.float32))[0])
    seen = set(tokens.tolist())
    assert seen <= allowed
    assert len(allowed) < 24 and seen == allowed  # it filtered, and every kept token shows


def test_logit_bias_and_min_p_validation():
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams(min_p=1.5)
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={3: 101})
    sp = SamplingParams(logit_bias={3: 100, 4: -100, 5: 2.5, 6: 0})
    assert sp.additive_bias == ((5, 2.5),)  # +-100 are the mask; 0 changes nothing
    bits = np.unpackbits(sp.token_mask(8).view(np.uint8), bitorder="little")[:8]
    assert bits.tolist() == [0, 0, 0, 1, 0, 0, 0, 0]


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(1, 300))
def test_first_argmax_is_numpys_argmax_with_ties_infinities_and_nans(seed, vocab):
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (12, vocab)).astype(np.float32)  # small ints: many ties
    x[1] = -np.inf  # a fully masked row
    x[2, rng.integers(vocab)] = np.inf
    x[3, rng.integers(vocab, size=2)] = np.nan  # argmax takes the first NaN
    np.testing.assert_array_equal(np.asarray(jax.jit(first_argmax)(jnp.asarray(x))),
                                  np.argmax(x, -1))


def test_drawn_tokens_are_jax_categoricals_draws():
    """The sampled path keeps jax.random.categorical's draw (the same Gumbel noise per
    seed and step), only its argmax is computed another way."""
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.standard_normal((32, 500)) * 3, jnp.float32)
    seeds = jnp.arange(32, dtype=jnp.uint32)
    steps = jnp.asarray(rng.integers(0, 100, 32), jnp.int32)
    ones = jnp.ones(32, jnp.float32)
    tokens, *_ = sample(logits, ones, jnp.zeros(32, jnp.int32), ones, seeds, steps)
    keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
    expected = jax.vmap(jax.random.categorical)(keys, logits)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(expected))
