"""Sampling parameters (host) and the on-device sampler shared by every executor."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp

MAX_TOP_LOGPROBS = 20


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling options, with vLLM's names and defaults.

    ``temperature == 0`` is greedy. ``top_k <= 0`` and ``top_p == 1`` disable those
    filters. ``seed`` makes sampling reproducible per request, independent of batching.
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Sequence[str] | str | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 (disabled) or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"logprobs must be between 0 and {MAX_TOP_LOGPROBS}")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is not None:
            object.__setattr__(self, "stop", tuple(self.stop))
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(s for s in (self.stop or ()) if s)


def sample(
    logits: jax.Array,  # f32[S, V]
    temperature: jax.Array,  # f32[S]; 0 = greedy
    top_k: jax.Array,  # i32[S]; <= 0 = off
    top_p: jax.Array,  # f32[S]; 1 = off
    seeds: jax.Array,  # u32[S] per-request seed
    steps: jax.Array,  # i32[S] index of the token being sampled (fresh key per token)
    num_top_logprobs: int = 0,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns (tokens i32[S], logprobs f32[S], top_ids i32[S, n], top_logprobs f32[S, n]).

    Logprobs are those of the unfiltered distribution (as vLLM reports them). The sort
    needed by top-k/top-p runs only when some slot uses them.
    """
    log_z = jax.nn.logsumexp(logits, axis=-1)  # f32[S]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def filtered(lg: jax.Array) -> jax.Array:
        sorted_desc = -jnp.sort(-lg, axis=-1)  # f32[S, V]
        vocab = lg.shape[-1]
        k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
        kth = jnp.take_along_axis(sorted_desc, (k - 1)[:, None], axis=-1)
        lg = jnp.where(lg < kth, -jnp.inf, lg)
        # top-p over the top-k survivors: keep the smallest prefix whose mass reaches p.
        sorted_desc = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_desc, -jnp.inf)
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        keep = mass_before < top_p[:, None]
        cutoff = jnp.min(jnp.where(keep, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        return jnp.where(lg < cutoff, -jnp.inf, lg)

    def drawn() -> jax.Array:
        safe_t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
        scaled = logits / safe_t
        needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
        scaled = jax.lax.cond(needs_filter, filtered, lambda lg: lg, scaled)
        keys = jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, steps)
        tokens = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(temperature > 0, tokens, greedy)

    # An all-greedy batch (the common serving case) skips the per-row random draw over
    # the whole vocabulary.
    tokens = jax.lax.cond(jnp.any(temperature > 0), drawn, lambda: greedy)
    chosen_lp = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - log_z
    if num_top_logprobs:
        top_logits, top_ids = jax.lax.top_k(logits, num_top_logprobs)
        top_lp = top_logits - log_z[:, None]
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, chosen_lp, top_ids.astype(jnp.int32), top_lp
