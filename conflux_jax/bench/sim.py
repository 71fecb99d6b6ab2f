"""``python -m conflux_jax.bench sim``: simulated SLO attainment and goodput per policy.

Every policy of :mod:`conflux_jax.sim.policies` runs the same workload through the
simulated executor at each arrival rate: the truth is the roofline (``--coeffs``: a fitted
machine model) with ``--noise``, and each scheduler plans with an estimate fitted to
profiles of that truth. Each baseline runs at the best setting of its sweep. A request
complies iff its i-th token arrives by
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
from conflux_jax.latency.roofline import ATTENTION_MODES, MODELS, kv_tokens_per_rank
from conflux_jax.scheduler.router import ROUTER_POLICIES
from conflux_jax.sim.policies import (
    POLICIES,
    SLOS,
    InstanceSpec,
    best_setting,
    instance_report,
    resolved,
    run_policy,
    sweep,
    swept_value,
)
from conflux_jax.slo import ATTAINMENT_TARGET as TARGET

DEFAULT_RATES = {
    "llama3.1-8b": [2, 4, 6, 8, 10, 12, 14, 16, 18, 20],
    "qwen3-14b": [2, 3, 4, 5, 6, 7, 8, 9, 10, 12],
    "qwen3-32b": [1, 2, 3, 4, 5, 6, 7, 8],
}


def run_one(spec: InstanceSpec, reqs: list) -> dict:
    rep = run_policy(spec, reqs)
    served = [r for r in rep.records if not r.aborted]
    # A served request that never got a token waited until the simulation ended.
    waits = sorted((r.first_token_s if r.first_token_s is not None else rep.sim_seconds)
                   - r.arrival_s for r in served)
    ttfts = [r.first_token_s - r.arrival_s for r in rep.records if r.first_token_s is not None]
    return {"attainment": rep.attainment, "iterations": rep.iterations,
            "preemptions": rep.preemptions, "aborted": sum(r.aborted for r in rep.records),
            "mean_ttft_s": sum(ttfts) / max(1, len(ttfts)), "sim_seconds": rep.sim_seconds,
            "slo_claim_violations": rep.slo_claim_violations,
            "max_wait_s": waits[-1] if waits else 0.0,
            "prefix_hit_rate": rep.prefix_hit_rate,
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
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES),
                    help="default: every policy (every one but DistServe with --instances)")
    ap.add_argument("--instances", type=int, default=1,
                    help="identical instances of --gpus each behind the global router; "
                         "--rates are then the total offered rates (default rates scale)")
    ap.add_argument("--routers", nargs="+", choices=list(ROUTER_POLICIES),
                    help="with --instances > 1, each policy runs behind each of these "
                         "routers (default: all)")
    ap.add_argument("--ttft", type=float, help="TTFT SLO seconds (default: paper's)")
    ap.add_argument("--tbt", type=float, help="TBT SLO seconds (default: paper's)")
    ap.add_argument("--coeffs", type=Path, help="fitted latency JSON for the conflux mesh")
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="turn off the engine's prefix cache (on by default: on a Mooncake "
                         "trace its hash_ids name each prompt's blocks, and the cache, "
                         "bounded by each instance's simulated KV pool, reuses them)")
    ap.add_argument("--unbounded-prefix-cache", action="store_true",
                    help="instead of the engine's cache, skip every block an earlier "
                         "request sent: unbounded and free, an upper bound only")
    ap.add_argument("--no-local-prefill", action="store_true",
                    help="a prefix hit's suffix always loads the cached KV and runs Ulysses "
                         "prefill (default: on its owner rank alone when the latency model "
                         "prices that lower)")
    ap.add_argument("--bounded-wait", action="store_true",
                    help="every policy with the serving engine's bounded-waiting rule (a "
                         "request past its TTFT deadline by one TTFT SLO is served first); "
                         "default: the paper's policies, which may starve late requests")
    ap.add_argument("--noise", type=float, default=0.0,
                    help="the truth's relative per-iteration jitter (std), e.g. 0.05")
    ap.add_argument("--estimate", choices=["fitted", "oracle"], default="fitted",
                    help="what schedulers plan with: a fit to profiles of the truth (as the "
                         "engine fits its own), or the truth itself (self-grading)")
    ap.add_argument("--attention", choices=list(ATTENTION_MODES), default="serial",
                    help="Conflux's attention phases: serial (as our step runs them) or the "
                         "paper's SM-partitioned overlap (1.28x max)")
    ap.add_argument("--no-sweep", action="store_true",
                    help="run each baseline at its default setting instead of sweeping "
                         "Chunked's budget, MuxWise's headroom and DistServe's split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write per-rate attainment here")
    ap.add_argument("--png", type=Path, help="attainment-vs-rate plot (default: beside --json)")
    args = ap.parse_args(argv)
    if args.instances < 1:
        ap.error("--instances must be at least 1")
    if args.routers and args.instances == 1:
        ap.error("--routers needs --instances > 1")
    disagg = [p for p in args.policies or () if POLICIES[p][0] == "disagg"]
    if args.instances > 1 and disagg:
        ap.error(f"{', '.join(disagg)} cannot run behind the global router (it routes "
                 "between its own prefill and decode replicas)")
    policies = args.policies or [p for p in POLICIES
                                 if args.instances == 1 or POLICIES[p][0] != "disagg"]
    routers = (args.routers or list(ROUTER_POLICIES)) if args.instances > 1 else ["conflux"]

    ttft = args.ttft or SLOS[args.model][0]
    tbt = args.tbt or SLOS[args.model][1]
    rates = args.rates or [r * args.instances for r in DEFAULT_RATES[args.model]]
    base = load_workload(args.trace, args.num_requests, args.seed)
    hashes = None
    caching = not args.no_prefix_caching
    if args.unbounded_prefix_cache:
        if args.trace in GENERATED:
            ap.error("--unbounded-prefix-cache needs a Mooncake trace (its hash_ids name "
                     "shared blocks)")
        caching = False
    if args.trace not in GENERATED and (caching or args.unbounded_prefix_cache):
        try:
            hashes = load_trace_hashes(args.trace)
        except ValueError:
            hashes = None  # a trace without hash ids: nothing for a cache to match
    max_ctx = MODELS[args.model].max_context
    workloads = {r: at_rate(base, r, args.num_requests, max_ctx, args.seed, hashes,
                            unbounded_cache=args.unbounded_prefix_cache)
                 for r in rates}
    t0 = time.time()
    results: dict[str, list[dict]] = {}
    settings: dict[str, dict] = {}
    specs = {(p if args.instances == 1 else f"{p} @{router}"): resolved(InstanceSpec(
        p, args.model, args.hardware, args.gpus, ttft, tbt, coeffs=args.coeffs,
        bounded_wait=args.bounded_wait, noise=args.noise, estimate=args.estimate,
        attention=args.attention, seed=args.seed, prefix_caching=caching,
        local_prefill=not args.no_local_prefill, instances=args.instances, router=router))
        for p in policies for router in routers}
    cands = {p: [s] if args.no_sweep else sweep(s) for p, s in specs.items()}
    bar = tqdm(total=sum(len(c) for c in cands.values()) * len(rates), desc="policy x rate")
    runs: dict[InstanceSpec, list[dict]] = {}

    def score(spec: InstanceSpec) -> tuple[float, float]:
        rows = [{"rate": r, **run_one(spec, workloads[r])} for r in rates]
        bar.update(len(rates))
        runs[spec] = rows
        att = [r["attainment"] for r in rows]
        return slo.goodput(rates, att), sum(att) / len(att)

    for p, spec in specs.items():
        if args.no_sweep:
            score(spec)
            best, tried = spec, []
        else:
            best, tried = best_setting(spec, score)
        results[p] = runs[best]
        settings[p] = {**instance_report(best), "swept": tried,
                       "chosen": swept_value(best)}
    bar.close()
    elapsed = time.time() - t0
    good = {p: slo.goodput(rates, [r["attainment"] for r in rows]) for p, rows in results.items()}

    pool = kv_tokens_per_rank(args.model, args.hardware, max(1, args.gpus // min(args.gpus, 4)))
    cache = (", unbounded prefix cache (upper bound)" if args.unbounded_prefix_cache else
             f", prefix cache bounded by the KV pool ({pool} tokens per Conflux rank)"
             if hashes is not None and caching else ", no prefix caching")
    cache += ", no owner-alone suffixes" if args.no_local_prefill and caching else ""
    cache += ", bounded waiting" if args.bounded_wait else ""
    cache += f", noise {args.noise:g}" if args.noise else ""
    cache += ", oracle estimate" if args.estimate == "oracle" else ""
    cache += ", paper's attention overlap" if args.attention == "paper" else ""
    fleet = f"{args.instances} instances of " if args.instances > 1 else ""
    title = (f"{fleet}{args.model} on {args.gpus}x {args.hardware}, {args.trace}{cache}, "
             f"SLO {ttft:g}s/{tbt * 1e3:g}ms, {args.num_requests} requests")
    print(title)
    w = max(20, *(len(p) for p in results))
    print(f"{'policy':<{w}} {'goodput (req/s)':>16}   attainment % at " +
          " ".join(f"{r:g}" for r in rates) + "   max wait (s) at " +
          " ".join(f"{r:g}" for r in rates) + "   prefix hit % at " +
          " ".join(f"{r:g}" for r in rates))
    capped = {p: bool(rows) and rows[-1]["attainment"] >= TARGET for p, rows in results.items()}
    for p, rows in results.items():
        att = " ".join(f"{100 * r['attainment']:.0f}" for r in rows)
        wait = " ".join(f"{r['max_wait_s']:.0f}" for r in rows)
        wait += "   " + " ".join(f"{100 * r['prefix_hit_rate']:.0f}" for r in rows)
        shown = (">=" if capped[p] else "") + f"{good[p]:g}"  # sweep ended still passing
        chosen = settings[p]["chosen"]
        print(f"{p:<{w}} {shown:>16}   {att}   {wait}"
              + (f"   [best of sweep: {chosen}]" if chosen is not None else ""))
    print(f"({elapsed:.1f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "bench": "sim", "model": args.model, "hardware": args.hardware,
            "gpus": args.gpus, "instances": args.instances,
            "routers": routers if args.instances > 1 else None, "trace": args.trace,
            "prefix_cache_model": "unbounded and free: an upper bound"
            if args.unbounded_prefix_cache else
            f"the engine's, bounded by each instance's KV pool ({pool} tokens per Conflux "
            "rank)" if hashes is not None and caching else None,
            "num_requests": args.num_requests, "bounded_wait": args.bounded_wait,
            "local_prefill": not args.no_local_prefill,
            "ttft_slo_s": ttft, "tbt_slo_s": tbt, "rates": rates, "target": TARGET,
            "latency_source": str(args.coeffs) if args.coeffs else "roofline",
            "noise": args.noise, "estimate": args.estimate, "attention": args.attention,
            "swept": not args.no_sweep, "settings": settings,
            "goodput_rps": good, "goodput_capped_by_sweep": capped, "results": results,
            "elapsed_s": elapsed}, indent=2))
    png = args.png or (args.json.with_suffix(".png") if args.json else None)
    if png:
        _plot(png, rates, results, title)
    return 0
