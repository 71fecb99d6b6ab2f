"""XLA's dot vs OpenBLAS in place for the dense layers, by row count (issue 19).

    python bench/linears_rows.py [--rows 1 2 4 8 16 32 64 128 256] [--rounds 3]

Times the default model's 30 dense layers (attention left out: ``bench.dense_bound``) on
each row count, both ways, alternating within every round; prints each way's fastest run
per round and the xla/blas ratio of the fastest. ``Decoder.run_layers``'s
``BLAS_MIN_ROWS``/``BLAS_MAX_ROWS`` come from this.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from conflux_jax.bench.dense_bound import _dense_fn
from conflux_jax.checkpoints import load_checkpoint
from conflux_jax.models import decoder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    ckpt = load_checkpoint("default")
    params = jax.device_put(ckpt.params)
    # Every row count through OpenBLAS here: the measurement the row range is chosen from.
    decoder.BLAS_MIN_ROWS, decoder.BLAS_MAX_ROWS = 1, max(args.rows)
    fns = {lin: _dense_fn(ckpt.config, False, lin) for lin in ("xla", "blas")}
    print(f"default model: {ckpt.config.num_layers} dense layers, fp32; fastest of "
          f"{args.repeats} per round, ms")
    for rows in args.rows:
        x = jnp.asarray(np.random.default_rng(0).standard_normal(
            (rows, ckpt.config.hidden_size)), jnp.float32)
        pos = jnp.arange(rows, dtype=jnp.int32)
        best: dict[str, list[float]] = {lin: [] for lin in fns}
        for _ in range(args.rounds):
            for lin, fn in fns.items():
                fn(params, x, pos).block_until_ready()  # compile / warm
                runs = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    fn(params, x, pos).block_until_ready()
                    runs.append(time.perf_counter() - t)
                best[lin].append(min(runs) * 1e3)
        ratio = min(best["xla"]) / min(best["blas"])
        print(f"  {rows:4d} rows  xla {' / '.join(f'{v:.1f}' for v in best['xla'])}   "
              f"blas {' / '.join(f'{v:.1f}' for v in best['blas'])}   xla/blas {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
