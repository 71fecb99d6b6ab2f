"""Single-device dense forward and generation: the numerical oracle.

Nothing here is paged, sharded or scheduled. Tests compare the Conflux executor, the
baselines and the kernels against these functions, and these functions against HF
transformers. ``ReferenceGenerator`` also serves the offline API when no mesh is used.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from conflux_jax.config import ModelConfig
from conflux_jax.models.decoder import Decoder
from conflux_jax.models.params import Params, linears_packed
from conflux_jax.sampling import MAX_TOP_LOGPROBS, SamplingParams, sample


def dense_attention(
    q: jax.Array,  # f[B, T, Hq, d]
    k: jax.Array,  # f[B, S, Hkv, d]
    v: jax.Array,  # f[B, S, Hkv, d]
    q_positions: jax.Array,  # i32[B, T]; query t sees keys at positions <= q_positions[b, t]
) -> jax.Array:  # f[B, T, Hq, d]
    """Causal softmax attention over a dense KV, in float32, GQA by head grouping."""
    b, t, hq, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, t, hkv, hq // hkv, d).astype(jnp.float32)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k.astype(jnp.float32)) / math.sqrt(d)
    key_pos = jnp.arange(k.shape[1])
    mask = key_pos[None, None, :] <= q_positions[:, :, None]  # [B, T, S]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, t, hq, d).astype(q.dtype)


@functools.partial(jax.jit, static_argnums=0)
def _forward(config: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
    model = Decoder(config, params)
    positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)

    def attend(layer, q, k, v, kv):
        o = dense_attention(q[None], k[None], v[None], positions[None])[0]
        return o, kv

    # Packed weights (models.params.pack_linears) run on the packed GEMM, others on XLA's dot.
    linears = "packed" if linears_packed(params) else "xla"
    x, _ = model.run_layers(model.embed_tokens(tokens), positions, attend, None, linears=linears)
    return model.logits(x)


def forward(config: ModelConfig, params: Params, tokens: Sequence[int] | np.ndarray) -> jax.Array:
    """Full-sequence causal forward of one sequence: tokens i32[T] -> logits f32[T, V]."""
    return _forward(config, params, jnp.asarray(tokens, jnp.int32))


# ---------------------------------------------------------------------------- generation
def _bucket(n: int, minimum: int) -> int:
    return max(minimum, 1 << max(0, math.ceil(math.log2(max(n, 1)))))


def _cache_attend(write_positions: jax.Array):
    """Attention against a dense cache ``(k, v)`` each f[L, B, S, Hkv, d]: write, then read."""

    def attend(layer, q, k, v, kv):
        kc, vc = kv
        b = jnp.arange(q.shape[0])[:, None]
        kc = kc.at[layer, b, write_positions].set(k.astype(kc.dtype))
        vc = vc.at[layer, b, write_positions].set(v.astype(vc.dtype))
        o = dense_attention(q, kc[layer], vc[layer], write_positions)
        return o, (kc, vc)

    return attend


@functools.partial(jax.jit, static_argnums=(0, 8), donate_argnums=(2,))
def _generate_step(
    config: ModelConfig,
    params: Params,
    cache: tuple[jax.Array, jax.Array],  # (k, v) f[L, B, S, Hkv, d], donated
    tokens: jax.Array,  # i32[B, T]
    positions: jax.Array,  # i32[B, T]
    last_index: jax.Array,  # i32[B] which of the T tokens to sample after
    sampling: dict[str, jax.Array],  # per-row temperature/top_k/top_p/seed/step, each [B]
    steps: jax.Array,  # i32[B]
    num_top_logprobs: int,
):
    model = Decoder(config, params)
    x, cache = model.run_layers(model.embed_tokens(tokens), positions,
                                _cache_attend(positions), cache)
    last = jnp.take_along_axis(x, last_index[:, None, None], axis=1)[:, 0]
    logits = model.logits(last)
    out = sample(logits, sampling["temperature"], sampling["top_k"], sampling["top_p"],
                 sampling["seed"], steps, num_top_logprobs)
    return cache, logits, out


class ReferenceGenerator:
    """Batched generation with a dense per-sequence KV cache on one device.

    Prompts are right-padded into one prefill; then every step decodes one token for all
    rows. Shapes are bucketed to powers of two so repeated calls reuse compilations.
    """

    def __init__(self, config: ModelConfig, params: Params, dtype: Any = jnp.float32):
        self.config = config
        self.dtype = jnp.dtype(dtype)
        self.params = jax.tree.map(lambda a: jnp.asarray(a, self.dtype), params)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: Sequence[SamplingParams],
        on_token: Callable[[int, int, float, dict[int, float]], bool],
        max_model_len: int | None = None,
    ) -> np.ndarray:
        """Run until ``on_token(row, token, logprob, top) -> finished`` is True for every row.

        Returns the logits of the first sampled position (f32[B, V]), handy for tests.
        """
        cfg = self.config
        max_len = max_model_len or cfg.max_position_embeddings
        n = len(prompts)
        if n == 0:
            return np.zeros((0, cfg.vocab_size), np.float32)
        lengths = np.array([len(p) for p in prompts], np.int32)
        if lengths.min() < 1:
            raise ValueError("every prompt needs at least one token")
        budget = [min(sp.max_tokens or max_len, max_len - int(ln))
                  for sp, ln in zip(sampling, lengths, strict=True)]
        if min(budget) < 1:
            raise ValueError(f"prompt of {int(lengths.max())} tokens leaves no room to "
                             f"generate within the {max_len}-token context")
        rows = _bucket(n, 1)
        prompt_bucket = _bucket(int(lengths.max()), 16)
        total = max(int(ln) + b for ln, b in zip(lengths, budget, strict=True))
        seq_bucket = min(_bucket(max(total, prompt_bucket), 64), max(max_len, prompt_bucket))
        seq_bucket = max(seq_bucket, prompt_bucket)

        tokens = np.zeros((rows, prompt_bucket), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = p
        positions = np.broadcast_to(np.arange(prompt_bucket, dtype=np.int32),
                                    (rows, prompt_bucket)).copy()
        lengths_padded = np.ones(rows, np.int32)
        lengths_padded[:n] = lengths
        sp_arrays = _sampling_arrays(sampling, rows)
        num_top = max((sp.logprobs or 0) for sp in sampling)
        num_top = min(MAX_TOP_LOGPROBS, num_top)

        shape = (cfg.num_layers, rows, seq_bucket, cfg.num_kv_heads, cfg.head_dim)
        cache = (jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))
        done = np.zeros(rows, bool)
        done[n:] = True
        step = np.zeros(rows, np.int32)
        cache, logits, out = _generate_step(
            cfg, self.params, cache, jnp.asarray(tokens), jnp.asarray(positions),
            jnp.asarray(lengths_padded - 1), sp_arrays, jnp.asarray(step), num_top)
        first_logits = np.asarray(logits[:n])
        pos = lengths_padded.copy()
        while True:
            toks, lps, top_ids, top_lps = (np.asarray(a) for a in out)
            for i in np.flatnonzero(~done):
                top = {int(t): float(lp) for t, lp in zip(top_ids[i], top_lps[i], strict=True)}
                done[i] = on_token(int(i), int(toks[i]), float(lps[i]), top)
            if done.all() or pos.max() >= seq_bucket:
                break
            step += 1
            cache, logits, out = _generate_step(
                cfg, self.params, cache, jnp.asarray(toks[:, None]), jnp.asarray(pos[:, None]),
                jnp.zeros(rows, jnp.int32), sp_arrays, jnp.asarray(step), num_top)
            pos += 1
        return first_logits


def _sampling_arrays(sampling: Sequence[SamplingParams], rows: int) -> dict[str, jax.Array]:
    seeds = np.random.default_rng().integers(0, 2**31 - 1, size=rows).astype(np.uint32)
    temp = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    for i, sp in enumerate(sampling):
        temp[i], top_k[i], top_p[i] = sp.temperature, sp.top_k, sp.top_p
        if sp.seed is not None:
            seeds[i] = np.uint32(sp.seed % 2**32)
    return {"temperature": jnp.asarray(temp), "top_k": jnp.asarray(top_k),
            "top_p": jnp.asarray(top_p), "seed": jnp.asarray(seeds)}
