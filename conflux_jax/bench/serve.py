"""``python -m conflux_jax.bench serve``: replay a workload against a server or the engine.

Targets: ``--url http://host:port`` streams OpenAI ``/v1/completions`` (token-id prompts,
``ignore_eos``, usage in the last chunk) with aiohttp; without ``--url`` the in-process
:class:`~conflux_jax.engine.Engine` serves the same requests on this machine. Each rate
of ``--rates`` is one run; prints vLLM's ``bench serve`` summary per rate plus
``deadline_attainment`` and, over the rates (and ``--bisect`` extra runs between the
last passing and first failing rate), ``goodput_rps``.

CPU scaling: a 135M model on 2 cores serves tens of tokens per second, so trace lengths
are multiplied by ``--prompt-scale``/``--output-scale`` and capped by
``--max-prompt-len``/``--max-output-len`` (defaults: 1/32 and 1/16, capped at 384 and
32 tokens); the scaling and the resulting percentiles are printed and saved.

``--turns T`` replays multi-turn chats (``serve_workload.multi_turn``): each follow-up
turn resends the conversation so far. Every summary reports the prefix-cache hit rate
(prompt tokens served from cache); ``--prefix-caching-ab`` runs the in-process engine with
caching on and then off on the same workload (``--local-prefill-ab``: with a hit's short
suffix prefilled on its owner rank alone, then always loaded and Ulysses-prefilled) and
prints them side by side, beside the brute-force count of what the replay makes reusable.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from conflux_jax import slo
from conflux_jax.bench.metrics import RequestResult, format_summary, summarize
from conflux_jax.bench.serve_workload import (
    LengthScaling,
    ServeRequest,
    at_rate,
    full_prompt,
    load_rows,
    multi_turn,
    percentiles,
    reusable_tokens,
    synthesize,
)
from conflux_jax.slo import ATTAINMENT_TARGET as TARGET

Runner = Callable[[list[ServeRequest]], list[RequestResult]]


# ---- in-process engine -----------------------------------------------------------------
def run_engine(engine: Any, reqs: list[ServeRequest], progress: bool = False
               ) -> tuple[list[RequestResult], float]:
    """Feed ``reqs`` to ``engine`` at their arrival offsets; returns results, duration.

    Arrivals due while a step runs are added right after it with their scheduled time as
    ``arrival_s``, exactly as a client that sent them then would see it.
    """
    from conflux_jax.sampling import SamplingParams

    results = [RequestResult(0.0, len(r.prompt_ids)) for r in reqs]
    by_id: dict[int, int] = {}
    sent: dict[int, list[int]] = {}
    outputs: dict[int, list[int]] = {}
    ended: set[int] = set()  # finished or failed: their follow-up turns may go
    t0 = time.perf_counter()
    todo = list(range(len(reqs)))
    bar = tqdm(total=len(reqs), desc="requests", disable=not progress, leave=False)

    def end(i: int) -> None:
        ended.add(i)
        outputs[i] = results[i].output_ids
        bar.update(1)

    while todo or engine.has_unfinished:
        now = time.perf_counter()
        for i in [i for i in todo if t0 + reqs[i].arrival_s <= now
                  and (reqs[i].follows is None or reqs[i].follows in ended)]:
            todo.remove(i)
            r, res = reqs[i], results[i]
            prev = r.follows
            res.send_s = t0 + r.arrival_s if prev is None else \
                max(t0 + r.arrival_s, max(results[prev].token_times, default=now))
            if prev is not None and not results[prev].success:
                res.error = "the previous turn failed"
                end(i)
                continue
            sent[i] = res.prompt_ids = full_prompt(reqs, i, sent, outputs)
            res.input_len = len(sent[i])
            try:
                rid = engine.add_request(sent[i], SamplingParams(
                    max_tokens=r.max_tokens, temperature=0, ignore_eos=True),
                    arrival_s=res.send_s)
                by_id[rid] = i
            except ValueError as e:  # EngineError: too long for this engine
                res.error = str(e)
                end(i)
        if not engine.has_unfinished:
            waits = [reqs[i].arrival_s for i in todo
                     if reqs[i].follows is None or reqs[i].follows in ended]
            if waits:
                time.sleep(max(0.0, t0 + min(waits) - time.perf_counter()))
            continue
        for out in engine.step():
            k = by_id.get(out.request_id)
            if k is None:
                continue
            res = results[k]
            if out.num_cached_tokens is not None:
                res.cached_tokens = out.num_cached_tokens
            if out.new_token_ids:
                res.token_times.extend([out.time_s] * len(out.new_token_ids))
                res.output_len += len(out.new_token_ids)
                res.output_ids.extend(out.new_token_ids)
            if out.finished:
                res.success = out.finish_reason != "error"
                res.error = "" if res.success else "engine step failed"
                end(k)
    bar.close()
    return results, time.perf_counter() - t0


def engine_from_model(model: str, max_model_len: int, policy: str, ttft_slo_s: float,
                      tbt_slo_s: float, mesh: str | None = None,
                      enable_prefix_caching: bool = True, local_prefill: bool = True) -> Any:
    """The default (or any checkpoint) model as an in-process engine on local devices."""
    from conflux_jax import LLM
    from conflux_jax.engine import EngineConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig

    cfg = EngineConfig(executor=ExecutorConfig(max_model_len=max_model_len, mesh=mesh),
                       policy=policy,
                       ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, profile=model,
                       enable_prefix_caching=enable_prefix_caching,
                       local_prefill=local_prefill)
    return LLM(model, max_model_len=max_model_len, engine_config=cfg).engine


# ---- OpenAI-compatible server ----------------------------------------------------------
async def _one(client: Any, url: str, model: str, reqs: list[ServeRequest], i: int,
               t0: float, results: list[RequestResult], sent: dict[int, list[int]],
               outputs: dict[int, list[int]], ended: dict[int, asyncio.Event]) -> None:
    r, res = reqs[i], results[i]
    try:
        if r.follows is not None:  # a follow-up turn goes once the previous one is answered
            await ended[r.follows].wait()
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        res.send_s = time.perf_counter()
        if r.follows is not None and not results[r.follows].success:
            res.error = "the previous turn failed"
            return
        sent[i] = res.prompt_ids = full_prompt(reqs, i, sent, outputs)
        res.input_len = len(sent[i])
        await _stream(client, url, model, sent[i], r.max_tokens, res)
    finally:
        outputs[i] = res.output_ids
        ended[i].set()


async def _stream(client: Any, url: str, model: str, prompt: list[int], max_tokens: int,
                  res: RequestResult) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    chunks = 0
    usage = None
    try:
        async with client.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return
            async for line in resp.content:  # SSE: one event per "data:" line
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                d = json.loads(data)
                if d.get("usage"):
                    usage = d["usage"]
                if d.get("choices"):
                    res.output_ids.extend(d["choices"][0].get("token_ids") or ())
                    if d["choices"][0].get("text"):
                        res.token_times.append(time.perf_counter())  # vLLM: non-empty chunks
                        chunks += 1
        res.output_len = int(usage["completion_tokens"]) if usage else chunks
        details = (usage or {}).get("prompt_tokens_details") or {}
        res.cached_tokens = int(details.get("cached_tokens") or 0)
        res.success = bool(res.token_times)
        if not res.success:
            res.error = "no tokens streamed"
    except Exception as e:  # a failed request is a data point, not a crash
        res.error = f"{type(e).__name__}: {e}"


def run_server(url: str, model: str, reqs: list[ServeRequest], timeout_s: float = 600.0
               ) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival offset, each on its own pooled connection.

    The client shares the host's cores with the server it measures, so it is aiohttp (a C
    HTTP parser; vLLM's ``bench serve`` client too): about a third of httpx's CPU per
    streamed chunk (bench/RESULTS.md)."""
    import aiohttp

    async def go() -> tuple[list[RequestResult], float]:
        results = [RequestResult(0.0, len(r.prompt_ids)) for r in reqs]
        sent: dict[int, list[int]] = {}
        outputs: dict[int, list[int]] = {}
        ended = {i: asyncio.Event() for i in range(len(reqs))}
        async with aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0),  # no cap: every request streams
                timeout=aiohttp.ClientTimeout(total=timeout_s)) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(_one(client, url.rstrip("/"), model, reqs, i, t0,
                                        results, sent, outputs, ended)
                                   for i in range(len(reqs))))
            return results, time.perf_counter() - t0

    return asyncio.run(go())


def server_model(url: str) -> str:
    """The first model id the server lists (``/v1/models``)."""
    import httpx

    d = httpx.get(f"{url.rstrip('/')}/v1/models", timeout=30).json()
    return d["data"][0]["id"]


# ---- sweep -----------------------------------------------------------------------------
def sweep(run: Callable[[list[ServeRequest]], tuple[list[RequestResult], float]],
          make: Callable[[float], list[ServeRequest]], rates: list[float], bisect: int,
          ttft_slo_s: float, tbt_slo_s: float, page_size: int = 16,
          pool_pages: int | None = None) -> dict[float, dict]:
    """Summaries per rate; ``bisect`` more runs between last pass and first fail. Each
    also counts (by brute force) the prompt tokens its replay made reusable, in all and
    within ``pool_pages`` of KV."""
    out: dict[float, dict] = {}

    def once(rate: float) -> dict:
        results, duration = run(make(rate))
        m = out[rate] = summarize(results, duration, ttft_slo_s, tbt_slo_s)
        done = sorted((r for r in results if r.success), key=lambda r: r.send_s)
        args = ([r.prompt_ids for r in done], [r.output_ids for r in done], page_size)
        m["reusable_tokens"] = reusable_tokens(*args)
        m["reusable_tokens_in_pool"] = reusable_tokens(*args, pool_pages) \
            if pool_pages else None
        return m

    for rate in tqdm(sorted(rates), desc="rates"):
        once(rate)
    for _ in range(bisect):
        passing = [r for r, m in out.items() if m["deadline_attainment"] >= TARGET]
        failing = [r for r, m in out.items() if m["deadline_attainment"] < TARGET]
        lo = max(passing, default=0.0)
        above = [r for r in failing if r > lo]
        if not above:
            break
        once((lo + min(above)) / 2 if lo else min(above) / 2)
    return dict(sorted(out.items()))


def goodput(per_rate: dict[float, dict], target: float = TARGET) -> float:
    return slo.goodput(list(per_rate), [m["deadline_attainment"] for m in per_rate.values()],
                       target)


def _table(per_rate: dict[float, dict]) -> str:
    lines = [f"{'rate (req/s)':<14}{'attainment':>12}{'req/s done':>12}{'TTFT p50 ms':>13}"
             f"{'TPOT p50 ms':>13}{'prefix hit %':>14}"]
    for rate, m in per_rate.items():
        lines.append(f"{rate:<14g}{100 * m['deadline_attainment']:>11.1f}%"
                     f"{m['request_throughput']:>12.2f}{m['median_ttft_ms']:>13.1f}"
                     f"{m['median_tpot_ms']:>13.1f}{100 * m['prefix_cache_hit_rate']:>13.1f}%")
    return "\n".join(lines)


_AB_HEAD = f"{'rate (req/s)':<14}{'TTFT p50 on ms':>16}{'off ms':>10}{'off/on':>8}"


def _off_over_on(rate: float, on: dict, off: dict, key: str) -> float:
    return off[rate][key] / max(on[rate][key], 1e-9)


def _ab_ttft(rate: float, on: dict, off: dict, ratio: float) -> str:
    """The TTFT columns of an on/off A/B row (under :data:`_AB_HEAD`)."""
    return (f"{rate:<14g}{on[rate]['median_ttft_ms']:>16.1f}"
            f"{off[rate]['median_ttft_ms']:>10.1f}{ratio:>8.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conflux_jax.bench serve",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="server base URL; omit to serve in-process")
    ap.add_argument("--model", default="default",
                    help="in-process: checkpoint to load; server: model id (default: first "
                         "listed by /v1/models)")
    ap.add_argument("--policy", default="conflux", help="in-process engine policy")
    ap.add_argument("--trace", default="conversation",
                    help="conversation | synthetic | a Mooncake .jsonl path | toolagent | "
                         "poisson")
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                    help="arrival rates (req/s), one run each")
    ap.add_argument("--bisect", type=int, default=0,
                    help="extra runs bisecting between the last passing and first failing rate")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-scale", type=float, default=1 / 32)
    ap.add_argument("--output-scale", type=float, default=1 / 16)
    ap.add_argument("--max-prompt-len", type=int, default=384)
    ap.add_argument("--max-output-len", type=int, default=32)
    ap.add_argument("--turns", type=int, default=1,
                    help="multi-turn replay: chats of this many consecutive trace rows, each "
                         "follow-up resending the conversation so far (1 = independent)")
    ap.add_argument("--turn-prompt-scale", type=float, default=1 / 128,
                    help="a follow-up turn's new user message: its row's length times this")
    ap.add_argument("--max-turn-prompt-len", type=int, default=64)
    # CPU-scale SLOs: the paper's GPU SLOs (1-2 s / 50-100 ms) are out of reach for a
    # 135M model on 2 cores, whose decode step alone is ~0.1-0.3 s.
    ap.add_argument("--ttft-slo", type=float, default=4.0, help="seconds (CPU-scale default)")
    ap.add_argument("--tbt-slo", type=float, default=1.0, help="seconds (CPU-scale default)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--no-prefix-caching", action="store_true",
                    help="in-process: run the engine with prefix caching off")
    ap.add_argument("--prefix-caching-ab", action="store_true",
                    help="in-process: the same workload with caching on, then off; prints "
                         "both and the TTFT ratio")
    ap.add_argument("--local-prefill-ab", action="store_true",
                    help="in-process, caching on: a hit's short suffix prefilled on its owner "
                         "rank alone when the latency model prefers it, then always loaded "
                         "and Ulysses-prefilled; prints both and the TTFT ratio")
    ap.add_argument("--warmup", type=int, default=4,
                    help="requests sent as one unmeasured burst first (compiles the steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write every summary here")
    args = ap.parse_args(argv)
    if args.url and (args.no_prefix_caching or args.prefix_caching_ab
                     or args.local_prefill_ab):
        ap.error("--no-prefix-caching, --prefix-caching-ab and --local-prefill-ab drive the "
                 "in-process engine; start the server with --no-enable-prefix-caching "
                 "instead")
    if args.no_prefix_caching and (args.prefix_caching_ab or args.local_prefill_ab):
        ap.error("--no-prefix-caching contradicts the A/B flags")
    if args.turns < 1:
        ap.error("--turns must be at least 1")

    scaling = LengthScaling(args.prompt_scale, args.output_scale, args.max_prompt_len,
                            args.max_output_len)
    turn_scaling = LengthScaling(args.turn_prompt_scale, 1.0, args.max_turn_prompt_len)
    rows = load_rows(args.trace, args.num_prompts, args.seed)
    variants: list[tuple[str, Runner, int | None]] = []  # (label, runner, pool pages)
    engines: dict[str, Any] = {}  # label -> the in-process engine
    if args.url:
        model = args.model if args.model != "default" else server_model(args.url)
        vocab = (100, 32000)  # token ids every supported tokenizer has (none special)
        variants.append((f"{args.url} ({model})",
                         lambda reqs: run_server(args.url, model, reqs), None))
    else:
        # (prefix caching, owner-alone suffix prefill)
        setups = [(not args.no_prefix_caching, True)]
        if args.local_prefill_ab:
            setups.append((True, False))
        if args.prefix_caching_ab:
            setups.append((False, True))
        vocab = (100, 32000)
        for caching, local in setups:
            engine = engine_from_model(args.model, args.max_model_len, args.policy,
                                       args.ttft_slo, args.tbt_slo,
                                       enable_prefix_caching=caching, local_prefill=local)
            vocab = (100, engine.model_config.vocab_size)
            kv = engine.executor.kv
            label = (f"in-process engine ({args.model}, policy {args.policy}, prefix caching "
                     f"{'on' if caching else 'off'}"
                     f"{'' if local or not caching else ', no owner-alone suffixes'})")
            engines[label] = engine
            variants.append((label, lambda reqs, e=engine: run_engine(e, reqs),
                             kv.num_pages * kv.num_ranks))

    def make(rate: float, run: str = "measured") -> list[ServeRequest]:
        # Each run's prompts are its own (tokens seeded by run and rate): a later run must
        # not find an earlier one's prompts in the server's prefix cache.
        seed = f"{args.seed}/{run}/{rate:g}"
        picked = at_rate(rows if args.turns == 1 else rows[:args.num_prompts], rate,
                         args.num_prompts, args.seed)
        if args.turns > 1:  # consecutive rows keep a chat's turns together
            return multi_turn(picked, args.turns, scaling, turn_scaling, vocab, seed)
        return synthesize(picked, scaling, vocab, seed)

    sample = make(1.0)
    lens = {"prompt": percentiles([len(r.prompt_ids) for r in sample]),
            "output": percentiles([r.max_tokens for r in sample])}
    scaling_text = (f"lengths x{args.prompt_scale:g} (prompt, cap {args.max_prompt_len}) / "
                    f"x{args.output_scale:g} (output, cap {args.max_output_len}); "
                    f"prompt P50/P95/max {lens['prompt']['p50']:g}/{lens['prompt']['p95']:g}/"
                    f"{lens['prompt']['max']:g}, output {lens['output']['p50']:g}/"
                    f"{lens['output']['p95']:g}/{lens['output']['max']:g}")
    if args.turns > 1:
        scaling_text += (f"; {args.turns}-turn chats, each follow-up adding x"
                         f"{args.turn_prompt_scale:g} of its row (cap "
                         f"{args.max_turn_prompt_len}) to the resent conversation")
    runs = {}
    for label, run, pool in variants:
        if args.warmup:  # other tokens than the measured prompts: it leaves them uncached
            first = [r for r in make(1.0, "warm-up") if r.follows is None][:args.warmup]
            run([ServeRequest(0.0, r.prompt_ids, r.max_tokens) for r in first])
        per_rate = sweep(run, make, args.rates, args.bisect, args.ttft_slo, args.tbt_slo,
                         pool_pages=pool)
        runs[label] = per_rate
        good = goodput(per_rate)
        print(f"target: {label}\nworkload: {args.trace}, {args.num_prompts} requests, "
              f"{scaling_text}")
        for rate, m in per_rate.items():
            print(format_summary(m, f"Serving Benchmark Result @ {rate:g} req/s", {
                "Reusable prompt tokens (brute force):": str(m["reusable_tokens"]),
                "Cached prompt tokens:": str(m["total_cached_tokens"])}))
        print(_table(per_rate))
        if (engine := engines.get(label)) is not None and engine.scheduler.local_prefills:
            sched = engine.scheduler
            print(f"suffixes prefilled on their owner rank alone (warm-up included): "
                  f"{sched.local_prefills} ({sched.local_prefill_tokens} tokens)")
        capped = per_rate[max(per_rate)]["deadline_attainment"] >= TARGET  # never failed
        print(f"goodput_rps (attainment >= {TARGET:.0%} at {args.ttft_slo:g} s TTFT / "
              f"{args.tbt_slo * 1e3:g} ms TBT): {'>=' if capped else ''}{good:g}"
              + ("  (every rate passed: raise --rates)" if capped else ""))
    ab = local_ab = None
    labels = list(runs)
    if args.local_prefill_ab:
        on, off = runs[labels[0]], runs[labels[1]]
        local_ab = {f"{r:g}": {
            "ttft_p50_load_over_local": _off_over_on(r, on, off, "median_ttft_ms"),
            "tpot_p50_load_over_local": _off_over_on(r, on, off, "median_tpot_ms")}
            for r in on}
        print("owner-alone suffixes on vs off (always load + Ulysses), caching on, one run:")
        print(f"{_AB_HEAD}{'TPOT p50 on ms':>16}{'off ms':>10}{'off/on':>8}")
        for r in on:
            a = local_ab[f"{r:g}"]
            print(f"{_ab_ttft(r, on, off, a['ttft_p50_load_over_local'])}"
                  f"{on[r]['median_tpot_ms']:>16.1f}"
                  f"{off[r]['median_tpot_ms']:>10.1f}{a['tpot_p50_load_over_local']:>8.2f}")
    if args.prefix_caching_ab:
        on, off = runs[labels[0]], runs[labels[-1]]
        ab = {f"{r:g}": {
            "ttft_p50_off_over_on": _off_over_on(r, on, off, "median_ttft_ms"),
            "cached_over_reusable_in_pool": on[r]["total_cached_tokens"]
            / max(1, on[r]["reusable_tokens_in_pool"] or 0),
            "cached_tokens": on[r]["total_cached_tokens"],
            "reusable_tokens": on[r]["reusable_tokens"],
            "reusable_tokens_in_pool": on[r]["reusable_tokens_in_pool"]} for r in on}
        print("prefix caching on vs off, same workload, one run:")
        print(f"{_AB_HEAD}{'cached':>9}{'reusable':>10}{'cached/reusable':>17}")
        for r in on:
            a = ab[f"{r:g}"]
            print(f"{_ab_ttft(r, on, off, a['ttft_p50_off_over_on'])}{a['cached_tokens']:>9}"
                  f"{a['reusable_tokens_in_pool']:>10}"
                  f"{100 * a['cached_over_reusable_in_pool']:>16.1f}%")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "bench": "serve", "trace": args.trace,
            "num_prompts": args.num_prompts, "seed": args.seed, "turns": args.turns,
            "scaling": {"prompt_scale": args.prompt_scale, "output_scale": args.output_scale,
                        "max_prompt_len": args.max_prompt_len,
                        "max_output_len": args.max_output_len,
                        "turn_prompt_scale": args.turn_prompt_scale,
                        "max_turn_prompt_len": args.max_turn_prompt_len,
                        "block_len": scaling.block_len, "lengths": lens},
            "ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo, "target_attainment": TARGET,
            # the first (or only) target at the top level; every one under "targets"
            "target": variants[0][0], "goodput_rps": goodput(runs[variants[0][0]]),
            "goodput_capped_by_sweep": runs[variants[0][0]][max(args.rates)]
            ["deadline_attainment"] >= TARGET,
            "rates": {f"{r:g}": m for r, m in runs[variants[0][0]].items()},
            "targets": {label: {
                "goodput_rps": goodput(pr),
                "goodput_capped_by_sweep": pr[max(pr)]["deadline_attainment"] >= TARGET,
                "rates": {f"{r:g}": m for r, m in pr.items()}} for label, pr in runs.items()},
            "prefix_caching_ab": ab, "local_prefill_ab": local_ab}, indent=2))
    return 0
