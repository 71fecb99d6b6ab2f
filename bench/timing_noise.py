"""How repeatable the estimator's timings are: the same batch, timed again and again.

    python bench/timing_noise.py [--mesh sp=4,tp=1] [--batches 6] [--trials 8] [--json PATH]

Builds the executor exactly as ``python -m conflux_jax.bench estimator --profile`` does,
draws random decode, prefill and mixed batches, and times each one ``--trials`` times, each
time the fastest of 5 back-to-back runs. Prints, per batch, the coefficient of variation
and the spread of those figures: the floor under any fit's MAPE. Compare XLA settings by
setting XLA_FLAGS yourself (it then wins over the simulated-device defaults).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np

# Importing jax does not start its backend: the device flags below still take effect.
from conflux_jax.bench.estimator import build_executor
from conflux_jax.engine.profiler import ProfileSpace, random_plan, release, wall_time
from conflux_jax.executor.mesh import devices_named_by, simulate_cpu_devices
from conflux_jax.scheduler.block_manager import BlockManager


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="sp=4,tp=1")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    simulate_cpu_devices(devices_named_by(args.mesh, 4))
    ex = build_executor("default", args.mesh, max_context=768)
    rng = np.random.default_rng(args.seed)
    bm = BlockManager(ex.num_ranks, ex.kv.num_pages, ex.kv.page_size)
    space = ProfileSpace(768, 128, 8, ex.buckets.max_tokens,
                         ex.model_config.vocab_size)
    rows = []
    for i in range(args.batches):
        kind = ("decode", "prefill", "mixed")[i % 3]
        plan = random_plan(rng, kind, ex.num_ranks, space, bm)
        ex.execute(plan)  # first run may compile
        times = [min(wall_time(ex, plan) for _ in range(5)) for _ in range(args.trials)]
        mean = statistics.fmean(times)
        rows.append({"kind": kind, "mean_s": mean,
                     "cv_pct": 100 * statistics.pstdev(times) / mean,
                     "range_pct": 100 * (max(times) - min(times)) / mean})
        print(f"{kind:<8} mean {mean:6.3f} s   cv {rows[-1]['cv_pct']:4.1f}%   "
              f"range {rows[-1]['range_pct']:4.1f}%", flush=True)
        release(bm, plan)
    print(f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    if args.json:
        args.json.write_text(json.dumps({"mesh": args.mesh, "trials": args.trials,
                                         "xla_flags": os.environ.get("XLA_FLAGS", ""),
                                         "batches": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
