"""``python -m conflux_jax.bench sim``: simulated SLO attainment and goodput per policy.

Every policy of :mod:`conflux_jax.sim.policies` runs the same workload through the
simulated executor (roofline latency model unless ``--coeffs`` gives fitted ones) at
each arrival rate. A request complies iff its i-th token arrives by
``arrival + TTFT_SLO + (i-1) * TBT_SLO``; goodput is the highest swept rate with at
least 95% compliant requests (§8.1). Prints a goodput table and writes JSON (and a PNG
of attainment vs rate).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from conflux_jax import slo
from conflux_jax.bench.workloads import (
    GENERATED,
    at_rate,
    load_trace_hashes,
    load_workload,
)
from conflux_jax.latency.roofline import MODELS
from conflux_jax.sim.policies import POLICIES, SLOS, InstanceSpec, run_policy
from conflux_jax.slo import ATTAINMENT_TARGET as TARGET

DEFAULT_RATES = {
    "llama3.1-8b": [2, 4, 6, 8, 10, 12, 14, 16, 18, 20],
    "qwen3-14b": [2, 3, 4, 5, 6, 7, 8, 9, 10, 12],
    "qwen3-32b": [1, 2, 3, 4, 5, 6, 7, 8],
}


def run_one(policy: str, model: str, hardware: str, gpus: int, reqs: list,
            ttft: float, tbt: float, coeffs: Path | None, bounded_wait: bool = False) -> dict:
    rep = run_policy(InstanceSpec(policy, model, hardware, gpus, ttft, tbt, coeffs,
                                  bounded_wait), reqs)
    served = [r for r in rep.records if not r.aborted]
    # A served request that never got a token waited until the simulation ended.
    waits = sorted((r.first_token_s if r.first_token_s is not None else rep.sim_seconds)
                   - r.arrival_s for r in served)
    ttfts = [r.first_token_s - r.arrival_s for r in rep.records if r.first_token_s is not None]
    return {"attainment": rep.attainment, "iterations": rep.iterations,
            "preemptions": rep.preemptions, "aborted": sum(r.aborted for r in rep.records),
            "mean_ttft_s": sum(ttfts) / max(1, len(ttfts)), "sim_seconds": rep.sim_seconds,
            "max_wait_s": waits[-1] if waits else 0.0,
            "p999_wait_s": waits[min(len(waits) - 1, int(0.999 * len(waits)))] if waits
            else 0.0}


def _plot(path: Path, rates: list[float], results: dict[str, list[dict]], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, rows in results.items():
        ax.plot(rates, [100 * r["attainment"] for r in rows], marker="o", label=policy)
    ax.axhline(100 * TARGET, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conflux_jax.bench sim",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-14b", choices=sorted(MODELS))
    ap.add_argument("--hardware", default="h100", choices=["h100", "h200"])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--trace", default="toolagent",
                    help="toolagent (synthetic, paper Table 3), poisson, conversation, "
                         "synthetic, or a .jsonl path")
    ap.add_argument("--rates", type=float, nargs="+")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--ttft", type=float, help="TTFT SLO seconds (default: paper's)")
    ap.add_argument("--tbt", type=float, help="TBT SLO seconds (default: paper's)")
    ap.add_argument("--coeffs", type=Path, help="fitted latency JSON for the conflux mesh")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="Mooncake traces only: skip the prefill of each prompt's leading "
                         "blocks that an earlier request sent (an unbounded prefix cache, "
                         "as vLLM / SGLang enable by default)")
    ap.add_argument("--bounded-wait", action="store_true",
                    help="every policy with the serving engine's bounded-waiting rule (a "
                         "request past its TTFT deadline by one TTFT SLO is served first); "
                         "default: the paper's policies, which may starve late requests")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write per-rate attainment here")
    ap.add_argument("--png", type=Path, help="attainment-vs-rate plot (default: beside --json)")
    args = ap.parse_args(argv)

    ttft = args.ttft or SLOS[args.model][0]
    tbt = args.tbt or SLOS[args.model][1]
    rates = args.rates or DEFAULT_RATES[args.model]
    base = load_workload(args.trace, args.num_requests, args.seed)
    hashes = None
    if args.prefix_cache:
        if args.trace in GENERATED:
            ap.error("--prefix-cache needs a Mooncake trace (its hash_ids name shared blocks)")
        hashes = load_trace_hashes(args.trace)
    max_ctx = MODELS[args.model].max_context
    workloads = {r: at_rate(base, r, args.num_requests, max_ctx, args.seed, hashes)
                 for r in rates}
    t0 = time.time()
    results: dict[str, list[dict]] = {p: [] for p in args.policies}
    jobs = [(p, r) for p in args.policies for r in rates]
    for policy, rate in tqdm(jobs, desc="policy x rate"):
        row = run_one(policy, args.model, args.hardware, args.gpus, workloads[rate],
                      ttft, tbt, args.coeffs, args.bounded_wait)
        results[policy].append({"rate": rate, **row})
    elapsed = time.time() - t0
    good = {p: slo.goodput(rates, [r["attainment"] for r in rows]) for p, rows in results.items()}

    cache = ", prefix cache" if args.prefix_cache else ""
    cache += ", bounded waiting" if args.bounded_wait else ""
    title = (f"{args.model} on {args.gpus}x {args.hardware}, {args.trace}{cache}, "
             f"SLO {ttft:g}s/{tbt * 1e3:g}ms, {args.num_requests} requests")
    print(title)
    print(f"{'policy':<20} {'goodput (req/s)':>16}   attainment % at " +
          " ".join(f"{r:g}" for r in rates) + "   max wait (s) at " +
          " ".join(f"{r:g}" for r in rates))
    capped = {p: bool(rows) and rows[-1]["attainment"] >= TARGET for p, rows in results.items()}
    for p, rows in results.items():
        att = " ".join(f"{100 * r['attainment']:.0f}" for r in rows)
        wait = " ".join(f"{r['max_wait_s']:.0f}" for r in rows)
        shown = (">=" if capped[p] else "") + f"{good[p]:g}"  # sweep ended still passing
        print(f"{p:<20} {shown:>16}   {att}   {wait}")
    print(f"({elapsed:.1f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "bench": "sim", "model": args.model, "hardware": args.hardware,
            "gpus": args.gpus, "trace": args.trace, "prefix_cache": args.prefix_cache,
            "num_requests": args.num_requests, "bounded_wait": args.bounded_wait,
            "ttft_slo_s": ttft, "tbt_slo_s": tbt, "rates": rates, "target": TARGET,
            "latency_source": str(args.coeffs) if args.coeffs else "roofline",
            "goodput_rps": good, "goodput_capped_by_sweep": capped, "results": results,
            "elapsed_s": elapsed}, indent=2))
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png:
        _plot(png, rates, results, title)
    return 0
