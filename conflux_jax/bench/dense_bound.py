"""The most output tokens/s any engine could reach on a ``compare`` workload on this machine.

Only the model's transformer blocks (norms, QKV, RoPE, O, FFN: attention replaced by the
identity) and, for the rows that sample, the LM head are timed: no attention, no KV cache,
no sampling, no host work. A perfect engine would still have to run these at least once
per token, so the workload's output tokens over the sum of those times bounds every
engine's output tokens/s, ours and the peers' alike. ``compare`` prints the bound beside
the peers it measures in the same run.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from conflux_jax.config import ModelConfig
from conflux_jax.models.decoder import Decoder
from conflux_jax.models.params import Params, pack_linears
from pallas_kernels.cpu_gemm import blas_available, packed_gemm_available

# Prefill is priced at steps of up to this many tokens: the linears already run near the
# CPU's matmul peak there, so larger steps gain nothing per token.
PREFILL_STEP_TOKENS = 512
DECODE_PAD = 16  # decode steps are also priced with their rows padded to a multiple of this


@dataclasses.dataclass(frozen=True)
class DenseBound:
    """A workload's bound and its parts (seconds are this run's fastest repeats)."""

    tokens_per_s: float
    prefill_s: float  # all prompts through the dense layers, at a full step's cost per token
    decode_s: float  # max_tokens - 1 steps of one row per request, with the LM head
    decode_step_s: float  # the faster of the unpadded and padded row counts

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@functools.cache  # one compiled function per (config, lm_head, linears), shared by repeats
def _dense_fn(config: ModelConfig, lm_head: bool, linears: str = "xla"):
    """(params, x f32[T, D], positions i32[T]) -> the blocks' output f32[T, D], or the
    logits f32[T, V] of every row; ``linears`` as in ``Decoder.run_layers``. The weights
    are arguments: closed over, they would be compiled in as constants."""

    def run(params: Params, x: jax.Array, positions: jax.Array) -> jax.Array:
        model = Decoder(config, params)
        h, _ = model.run_layers(x, positions, lambda layer, q, k, v, kv: (q, kv), None,
                                linears=linears)
        return model.logits(h) if lm_head else h

    return jax.jit(run)


_last_packed: list[tuple[Params, Params]] = []  # (params, packed) of the last call


def _packed(params: Params) -> Params:
    """``params`` packed for the packed GEMM (once per params object: bounds repeat)."""
    if not _last_packed or _last_packed[0][0] is not params:
        _last_packed[:] = [(params, jax.device_put(pack_linears(jax.device_get(params))))]
    return _last_packed[0][1]


def dense_seconds(config: ModelConfig, params: Params, rows: int, lm_head: bool,
                  repeats: int = 5) -> float:
    """Fastest of ``repeats`` runs of the dense layers on ``rows`` tokens, with each way of
    running the linears this host can (XLA's dot; OpenBLAS and the packed GEMM where they
    build): a bound takes the fastest."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal(
        (rows, config.hidden_size)), jnp.float32)
    positions = jnp.arange(rows, dtype=jnp.int32)
    best = float("inf")
    routes = {"xla": lambda: params}
    if blas_available()[0]:
        routes["blas"] = lambda: params
    if packed_gemm_available()[0]:
        routes["packed"] = lambda: _packed(params)
    for linears, weights in routes.items():
        fn, w = _dense_fn(config, lm_head, linears), weights()
        fn(w, x, positions).block_until_ready()  # compile

        def once() -> float:
            t = time.perf_counter()
            fn(w, x, positions).block_until_ready()  # noqa: B023 (called right here)
            return time.perf_counter() - t

        best = min(best, *(once() for _ in range(repeats)))
    return best


def dense_bound(config: ModelConfig, params: Params, concurrency: int, prompt_len: int,
                max_tokens: int, repeats: int = 5) -> DenseBound:
    """The bound for ``concurrency`` requests of ``prompt_len`` tokens, sent at once, each
    generating ``max_tokens``: every prompt token through the dense layers, then
    ``max_tokens - 1`` decode steps of one row per request (the first token comes from
    prefill; all requests arrive together, so no decode can ride along their prefill)."""
    prompt_tokens = concurrency * prompt_len
    step = min(prompt_tokens, PREFILL_STEP_TOKENS)
    # A partial last step is priced at the full step's per-token cost (never more than
    # it costs: smaller steps are no cheaper per token), so the bound stays a bound.
    prefill = prompt_tokens / step * dense_seconds(config, params, step, False, repeats)
    # An engine may pad its rows (ours runs 16-row decode buckets): on this CPU a 16-row
    # step can beat a 4-row one, so the bound takes the faster.
    padded = -(-concurrency // DECODE_PAD) * DECODE_PAD
    decode_step = min(dense_seconds(config, params, rows, True, repeats)
                      for rows in sorted({concurrency, padded}))
    decode = (max_tokens - 1) * decode_step
    return DenseBound(concurrency * max_tokens / (prefill + decode), prefill, decode,
                      decode_step)
