"""``python -m conflux_jax.bench scheduler-overhead``: per-iteration scheduling latency.

Reproduces paper Table 5: ConfluxServe's ``schedule()`` time at pending-queue depths
10/50/100/500 with 4 ranks and 128 resident decodes (Qwen3-14B roofline, H100). After
each timed step the state is restored (new decodes beyond 128 are dropped, the queue is
refilled to its depth) so every step sees the same load; restoring is not timed.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from conflux_jax.bench.workloads import toolagent_like
from conflux_jax.scheduler.request import Request
from conflux_jax.sim.policies import SLOS, InstanceSpec, build_instance

PAPER_MS = {10: (0.36, 0.05), 50: (0.47, 0.05), 100: (0.56, 0.05), 500: (1.04, 0.05)}


def measure(depth: int, decodes: int = 128, steps: int = 100, warmup: int = 10,
            seed: int = 0, model: str = "qwen3-14b", hardware: str = "h100",
            gpus: int = 4) -> list[float]:
    ttft, tbt = SLOS[model]
    sched, ex = build_instance(InstanceSpec("ConfluxServe", model, hardware, gpus, ttft, tbt))
    rng = random.Random(seed)
    lengths = toolagent_like(decodes + depth * 4 + steps * 64, seed)
    nxt = 0

    def new_request(now: float, prompt: int | None = None, out: int = 500) -> Request:
        nonlocal nxt
        _, p, _ = lengths[nxt % len(lengths)]
        nxt += 1
        return Request(nxt, now - rng.uniform(0.0, 1.5), prompt or min(p, 32_000), out)

    # Bring up the resident decodes (short prompts so that this is quick).
    for _ in range(decodes):
        assert sched.add(new_request(0.0, prompt=rng.randint(1000, 8000), out=50_000))
    while sched.num_pending:
        plan = sched.schedule(ex.now())
        sched.commit(plan, ex.execute(plan))
    base_decodes = set(sched.decode_ranks())
    for _ in range(depth):
        sched.add(new_request(ex.now()))
    times: list[float] = []
    # Long-lived setup objects go to the permanent generation, as a serving process
    # would do after warm-up, so full collections do not land inside timed steps.
    gc.collect()
    gc.freeze()
    for step in range(warmup + steps):
        now = ex.now()
        t0 = time.perf_counter()
        plan = sched.schedule(now)
        dt = time.perf_counter() - t0
        if step >= warmup:
            times.append(dt * 1e3)
        sched.commit(plan, ex.execute(plan))
        for rid in set(sched.decode_ranks()) - base_decodes:
            sched.abort(rid)  # keep exactly the resident decodes
        while sched.num_pending < depth:
            assert sched.add(new_request(ex.now()))
    gc.unfreeze()
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conflux_jax.bench scheduler-overhead",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--depths", type=int, nargs="+", default=[10, 50, 100, 500])
    ap.add_argument("--decodes", type=int, default=128)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    rows = []
    for depth in tqdm(args.depths, desc="queue depths"):
        t = measure(depth, args.decodes, args.steps, seed=args.seed)
        rows.append({"depth": depth, "mean_ms": statistics.fmean(t),
                     "std_ms": statistics.pstdev(t), "p50_ms": statistics.median(t),
                     "max_ms": max(t), "steps": len(t),
                     "paper_mean_ms": PAPER_MS.get(depth, (None,))[0],
                     "paper_std_ms": PAPER_MS.get(depth, (None, None))[1]})
    print(f"scheduler overhead, 4 ranks, {args.decodes} resident decodes "
          f"(mean ± std over {args.steps} steps)")
    print(f"{'depth':>6} {'ours (ms)':>16} {'paper Table 5 (ms)':>20}")
    for r in rows:
        paper = (f"{r['paper_mean_ms']:.2f} ± {r['paper_std_ms']:.2f}"
                 if r["paper_mean_ms"] is not None else "-")
        print(f"{r['depth']:>6} {r['mean_ms']:>9.3f} ± {r['std_ms']:.3f} {paper:>20}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bench": "scheduler-overhead", "ranks": 4,
                                         "decodes": args.decodes, "rows": rows}, indent=2))
    return 0
