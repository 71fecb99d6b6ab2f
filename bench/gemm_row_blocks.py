"""The packed GEMM with and without row blocks, on a prefill step's row counts (issue 19).

    python bench/gemm_row_blocks.py [--rows 256 512 1024 2048] [--blocks 0 auto 512]
                                    [--rounds 4]

Runs the default model's four dense matrices (QKV, O, gate/up, down) over 30 stacked layers
in one jitted loop, as a step does, with ``$CONFLUX_GEMM_XBLOCK_KB`` set per variant (read by
the handler on every call: ``0`` one block, ``auto`` the handler's own choice from the L2
size, a number that many KiB of x per block). The variants alternate within every round;
prints each one's best GFLOP/s and the median over rounds of the first variant's time over
each other's (paired, > 1: faster than the first). The products must agree.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.cpu_gemm import pack_weight, packed_matmul

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (K, N) of SmolLM2-135M's


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 512, 1024, 2048])
    ap.add_argument("--blocks", nargs="+", default=["0", "auto", "512"])
    ap.add_argument("--rounds", type=int, default=4)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    weights = [jnp.asarray(pack_weight(0.05 * rng.standard_normal((LAYERS, k, n),
                                                                  dtype=np.float32)))
               for k, n in SHAPES]

    @jax.jit
    def layers(x: jax.Array) -> jax.Array:  # x f32[M, 576] -> f32[] (keeps every product)
        def body(layer, acc):
            for (k, n), w in zip(SHAPES, weights, strict=True):
                xin = jnp.tile(x, (1, -(-k // x.shape[1])))[:, :k]
                acc = acc + packed_matmul(xin, w, layer, n)[:, :8].sum()
            return acc
        return jax.lax.fori_loop(0, LAYERS, body, jnp.float32(0))

    for m in args.rows:
        x = jnp.asarray(rng.standard_normal((m, SHAPES[0][0]), dtype=np.float32))
        flops = 2 * m * LAYERS * sum(k * n for k, n in SHAPES)
        times: dict[str, list[float]] = {v: [] for v in args.blocks}
        first = None
        for _ in range(args.rounds):
            for v in args.blocks:
                os.environ["CONFLUX_GEMM_XBLOCK_KB"] = "" if v == "auto" else v
                out = float(layers(x))
                first = out if first is None else first
                if abs(out - first) > 1e-4 * abs(first) + 1e-3:
                    raise SystemExit(f"blocks {v}: {out} differs from {first}")
                runs = []
                for _ in range(3):
                    t0 = time.perf_counter()
                    layers(x).block_until_ready()
                    runs.append(time.perf_counter() - t0)
                times[v].append(min(runs))
        base = args.blocks[0]
        cells = "  ".join(f"{v}: {flops / min(t) / 1e9:4.0f} GFLOP/s" for v, t in times.items())
        ratios = {v: statistics.median(a / b for a, b in zip(times[base], times[v], strict=True))
                  for v in args.blocks[1:]}
        paired = " ".join(f"{v} {r:.3f}x" for v, r in ratios.items())
        print(f"{m:5d} rows  {cells}  | over {base}: {paired}", flush=True)
    os.environ.pop("CONFLUX_GEMM_XBLOCK_KB", None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
