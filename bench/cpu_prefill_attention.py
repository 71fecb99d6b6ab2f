"""The CPU prefill attention handler alone, on SmolLM2-135M's shapes (issue 19).

    python bench/cpu_prefill_attention.py [--layers 30] [--repeats 7]

Times ``paged_prefill`` (pallas_kernels/cpu_attention) over ``--layers`` calls in one jitted
loop, as a step's layer loop makes them, on a pool of the default model's size (7680 pages
of 16 tokens, 3 KV heads, 9 query heads, d = 64) with each sequence's pages scattered over
it; cases of one 512-token chunk: 4 prompts of 128 tokens, 2 of 256, 1 of 512, and 4
chunks of 128 at the end of 512-token contexts. Prints the fastest run per case and the
causal work's rate (FLOPs of the visible query-key pairs only). Compare revisions by
running it in each.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_attention import paged_attention_available, paged_prefill

PAGES, PAGE, KV_HEADS, Q_HEADS, D, ROWS, MAX_SEQS, WIDTH = 7680, 16, 3, 9, 64, 512, 8, 32
CASES = ((4, 128, 128), (2, 256, 256), (1, 512, 512), (4, 128, 512))  # seqs, queries, keys


def time_case(k: jax.Array, v: jax.Array, seqs: int, qlen: int, ctx: int, layers: int,
              repeats: int, rng: np.random.Generator) -> float:
    """Fastest seconds for ``layers`` calls on ``seqs`` sequences of ``qlen`` new tokens
    each at the end of ``ctx`` keys."""
    q = jnp.asarray(rng.standard_normal((ROWS, Q_HEADS, D), np.float32))
    kv_lens = jnp.asarray(np.r_[np.full(seqs, ctx), np.zeros(MAX_SEQS - seqs)], jnp.int32)
    table = np.zeros((MAX_SEQS, WIDTH), np.int32)
    for s in range(seqs):
        table[s] = rng.choice(PAGES, WIDTH, replace=False)
    cu = jnp.asarray(np.r_[np.arange(seqs + 1) * qlen, np.full(MAX_SEQS - seqs, seqs * qlen)],
                     jnp.int32)

    @jax.jit
    def run(q: jax.Array) -> jax.Array:  # f32[ROWS, Hq, d]
        def layer(_: int, acc: jax.Array) -> jax.Array:  # each call depends on the last
            return acc + paged_prefill(q + acc * 1e-9, k, v, kv_lens, jnp.asarray(table), cu,
                                       jnp.int32(seqs))
        return jax.lax.fori_loop(0, layers, layer, jnp.zeros_like(q))

    run(q).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(q).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    ok, why = paged_attention_available()
    if not ok:
        raise SystemExit(f"the CPU attention handlers cannot run here: {why}")
    rng = np.random.default_rng(0)
    k, v = (jnp.asarray(rng.standard_normal((PAGES, PAGE, KV_HEADS, D), np.float32))
            for _ in range(2))
    for seqs, qlen, ctx in CASES:
        best = time_case(k, v, seqs, qlen, ctx, args.layers, args.repeats, rng)
        pairs = seqs * sum(ctx - qlen + t + 1 for t in range(qlen))  # visible (query, key)
        flops = 4 * pairs * Q_HEADS * D * args.layers  # QK and PV, a multiply-add each
        print(f"{seqs} x {qlen} new tokens, {ctx} keys each: {best * 1e3:6.1f} ms for "
              f"{args.layers} layers, {flops / best / 1e9:5.0f} GFLOP/s of causal work")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
