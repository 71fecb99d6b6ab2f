"""A prefix hit's short suffix: on its owner rank alone vs load + Ulysses (issue 14).

    XLA_FLAGS=--xla_force_host_platform_device_count=4 \
        python bench/local_prefill_ab.py [--mesh sp=4,tp=1] [--prefix 448] [--suffix 16 32]

Two engines on the default model, the same mesh, caching on in both: one may prefill a
hit's suffix on the owner alone (when its latency model prefers it), the other always
loads the cached KV and runs Ulysses prefill. Each trial sends a fresh prompt to both
(unmeasured: it fills the cache), then the prompt plus a fresh suffix, timing that second
request's time to its first token on an idle engine; the engines alternate which goes
first. Prints each engine's median hit latency per suffix length, the off/on ratio, and
how many hits took the owner-alone path; the greedy first tokens must agree.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from conflux_jax.bench.serve import engine_from_model
from conflux_jax.engine import Engine
from conflux_jax.sampling import SamplingParams

GREEDY_ONE = SamplingParams(max_tokens=1, temperature=0.0)


def _hit_latency(engine: Engine, prefix: list[int], suffix: list[int]) -> tuple[float, int]:
    engine.generate([prefix], [GREEDY_ONE])
    t0 = time.perf_counter()
    out = engine.generate([prefix + suffix], [GREEDY_ONE])[0]
    return time.perf_counter() - t0, out.outputs[0].token_ids[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default=None, help="default: every local device as SP ranks")
    ap.add_argument("--prefix", type=int, default=448, help="cached prompt tokens")
    ap.add_argument("--suffix", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--trials", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured trials per length")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    engines = {local: engine_from_model("default", args.max_model_len, "conflux", 4.0, 1.0,
                                        mesh=args.mesh, local_prefill=local)
               for local in (True, False)}
    vocab = engines[True].model_config.vocab_size
    rng = np.random.default_rng(0)
    rows = {}
    for length in args.suffix:
        times: dict[bool, list[float]] = {True: [], False: []}
        before = engines[True].scheduler.local_prefills
        for trial in range(args.warmup + args.trials):
            prefix = rng.integers(10, vocab, args.prefix).tolist()
            suffix = rng.integers(10, vocab, length).tolist()
            order = (True, False) if trial % 2 == 0 else (False, True)
            got = {}
            for local in order:
                dt, got[local] = _hit_latency(engines[local], prefix, suffix)
                if trial >= args.warmup:
                    times[local].append(dt)
            if got[True] != got[False]:
                raise SystemExit(f"greedy first tokens differ: {got}")
        on, off = (statistics.median(times[k]) for k in (True, False))
        rows[length] = {"on_ms": 1e3 * on, "off_ms": 1e3 * off, "off_over_on": off / on,
                        "owner_alone_hits": engines[True].scheduler.local_prefills - before,
                        "hits": args.warmup + args.trials}
    mesh = engines[True].executor.mesh_spec
    print(f"hit of a {args.prefix}-token cached prefix, idle engine, mesh {mesh}, "
          f"median of {args.trials} interleaved trials:")
    print(f"{'suffix':>7}{'owner alone ms':>16}{'load+Ulysses ms':>17}{'off/on':>8}"
          f"{'owner-alone hits':>18}")
    for length, r in rows.items():
        print(f"{length:>7}{r['on_ms']:>16.1f}{r['off_ms']:>17.1f}{r['off_over_on']:>8.2f}"
              f"{r['owner_alone_hits']:>12}/{r['hits']}")
    if args.json:
        args.json.write_text(json.dumps({"bench": "local_prefill_ab", "mesh": str(mesh),
                                         "prefix": args.prefix, "trials": args.trials,
                                         "results": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
