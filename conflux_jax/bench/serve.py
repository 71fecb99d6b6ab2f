"""``python -m conflux_jax.bench serve``: replay a workload against a server or the engine.

Targets: ``--url http://host:port`` streams OpenAI ``/v1/completions`` (token-id prompts,
``ignore_eos``, usage in the last chunk) with httpx; without ``--url`` the in-process
:class:`~conflux_jax.engine.Engine` serves the same requests on this machine. Each rate
of ``--rates`` is one run; prints vLLM's ``bench serve`` summary per rate plus
``deadline_attainment`` and, over the rates (and ``--bisect`` extra runs between the
last passing and first failing rate), ``goodput_rps``.

CPU scaling: a 135M model on 2 cores serves tens of tokens per second, so trace lengths
are multiplied by ``--prompt-scale``/``--output-scale`` and capped by
``--max-prompt-len``/``--max-output-len`` (defaults: 1/32 and 1/16, capped at 384 and
32 tokens); the scaling and the resulting percentiles are printed and saved.
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
    load_rows,
    percentiles,
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
    t0 = time.perf_counter()
    i, n = 0, len(reqs)
    bar = tqdm(total=n, desc="requests", disable=not progress, leave=False)
    while i < n or engine.has_unfinished:
        now = time.perf_counter()
        while i < n and t0 + reqs[i].arrival_s <= now:
            r, res = reqs[i], results[i]
            res.send_s = t0 + r.arrival_s
            try:
                rid = engine.add_request(r.prompt_ids, SamplingParams(
                    max_tokens=r.max_tokens, temperature=0, ignore_eos=True),
                    arrival_s=res.send_s)
                by_id[rid] = i
            except ValueError as e:  # EngineError: too long for this engine
                res.error = str(e)
                bar.update(1)
            i += 1
        if not engine.has_unfinished:
            if i < n:
                time.sleep(max(0.0, t0 + reqs[i].arrival_s - time.perf_counter()))
            continue
        for out in engine.step():
            k = by_id.get(out.request_id)
            if k is None:
                continue
            res = results[k]
            if out.new_token_ids:
                res.token_times.extend([out.time_s] * len(out.new_token_ids))
                res.output_len += len(out.new_token_ids)
            if out.finished:
                res.success = out.finish_reason != "error"
                res.error = "" if res.success else "engine step failed"
                bar.update(1)
    bar.close()
    return results, time.perf_counter() - t0


def engine_from_model(model: str, max_model_len: int, policy: str, ttft_slo_s: float,
                      tbt_slo_s: float, mesh: str | None = None) -> Any:
    """The default (or any checkpoint) model as an in-process engine on local devices."""
    from conflux_jax import LLM
    from conflux_jax.engine import EngineConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig

    cfg = EngineConfig(executor=ExecutorConfig(max_model_len=max_model_len, mesh=mesh),
                       policy=policy,
                       ttft_slo_s=ttft_slo_s, tbt_slo_s=tbt_slo_s, profile=model)
    return LLM(model, max_model_len=max_model_len, engine_config=cfg).engine


# ---- OpenAI-compatible server ----------------------------------------------------------
async def _one(client: Any, url: str, model: str, r: ServeRequest, t0: float,
               res: RequestResult) -> None:
    await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
    res.send_s = time.perf_counter()
    body = {"model": model, "prompt": r.prompt_ids, "max_tokens": r.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = 0
    usage = None
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                d = json.loads(data)
                if d.get("usage"):
                    usage = d["usage"]
                if d.get("choices") and d["choices"][0].get("text"):
                    res.token_times.append(time.perf_counter())  # vLLM: non-empty chunks
                    chunks += 1
        res.output_len = int(usage["completion_tokens"]) if usage else chunks
        res.success = bool(res.token_times)
        if not res.success:
            res.error = "no tokens streamed"
    except Exception as e:  # a failed request is a data point, not a crash
        res.error = f"{type(e).__name__}: {e}"


def run_server(url: str, model: str, reqs: list[ServeRequest], timeout_s: float = 600.0,
               transport: Any = None) -> tuple[list[RequestResult], float]:
    """Send every request at its arrival offset over one connection pool."""
    import httpx

    async def go() -> tuple[list[RequestResult], float]:
        results = [RequestResult(0.0, len(r.prompt_ids)) for r in reqs]
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits,
                                     transport=transport) as client:
            t0 = time.perf_counter()
            await asyncio.gather(*(_one(client, url.rstrip("/"), model, r, t0, res)
                                   for r, res in zip(reqs, results, strict=True)))
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
          ttft_slo_s: float, tbt_slo_s: float) -> dict[float, dict]:
    """Summaries per rate; ``bisect`` more runs between last pass and first fail."""
    out: dict[float, dict] = {}

    def once(rate: float) -> dict:
        results, duration = run(make(rate))
        out[rate] = summarize(results, duration, ttft_slo_s, tbt_slo_s)
        return out[rate]

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
    # CPU-scale SLOs: the paper's GPU SLOs (1-2 s / 50-100 ms) are out of reach for a
    # 135M model on 2 cores, whose decode step alone is ~0.1-0.3 s.
    ap.add_argument("--ttft-slo", type=float, default=4.0, help="seconds (CPU-scale default)")
    ap.add_argument("--tbt-slo", type=float, default=1.0, help="seconds (CPU-scale default)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=4,
                    help="requests sent as one unmeasured burst first (compiles the steps)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write every summary here")
    args = ap.parse_args(argv)

    scaling = LengthScaling(args.prompt_scale, args.output_scale, args.max_prompt_len,
                            args.max_output_len)
    rows = load_rows(args.trace, args.num_prompts, args.seed)
    if args.url:
        model = args.model if args.model != "default" else server_model(args.url)
        vocab = (100, 32000)  # token ids every supported tokenizer has (none special)
        run = lambda reqs: run_server(args.url, model, reqs)  # noqa: E731
        target = f"{args.url} ({model})"
    else:
        engine = engine_from_model(args.model, args.max_model_len, args.policy,
                                   args.ttft_slo, args.tbt_slo)
        vocab = (100, engine.model_config.vocab_size)
        run = lambda reqs: run_engine(engine, reqs)  # noqa: E731
        target = f"in-process engine ({args.model}, policy {args.policy})"

    def make(rate: float) -> list[ServeRequest]:
        return synthesize(at_rate(rows, rate, args.num_prompts, args.seed), scaling, vocab,
                          args.seed)

    sample = make(1.0)
    lens = {"prompt": percentiles([len(r.prompt_ids) for r in sample]),
            "output": percentiles([r.max_tokens for r in sample])}
    if args.warmup:
        burst = [ServeRequest(0.0, r.prompt_ids, r.max_tokens) for r in sample[:args.warmup]]
        run(burst)
    per_rate = sweep(run, make, args.rates, args.bisect, args.ttft_slo, args.tbt_slo)
    good = goodput(per_rate)
    scaling_text = (f"lengths x{args.prompt_scale:g} (prompt, cap {args.max_prompt_len}) / "
                    f"x{args.output_scale:g} (output, cap {args.max_output_len}); "
                    f"prompt P50/P95/max {lens['prompt']['p50']:g}/{lens['prompt']['p95']:g}/"
                    f"{lens['prompt']['max']:g}, output {lens['output']['p50']:g}/"
                    f"{lens['output']['p95']:g}/{lens['output']['max']:g}")
    print(f"target: {target}\nworkload: {args.trace}, {args.num_prompts} requests, "
          f"{scaling_text}")
    for rate, m in per_rate.items():
        print(format_summary(m, f"Serving Benchmark Result @ {rate:g} req/s"))
    print(f"{'rate (req/s)':<14}{'attainment':>12}{'req/s done':>12}{'TTFT p50 ms':>13}"
          f"{'TPOT p50 ms':>13}")
    for rate, m in per_rate.items():
        print(f"{rate:<14g}{100 * m['deadline_attainment']:>11.1f}%"
              f"{m['request_throughput']:>12.2f}{m['median_ttft_ms']:>13.1f}"
              f"{m['median_tpot_ms']:>13.1f}")
    capped = per_rate[max(per_rate)]["deadline_attainment"] >= TARGET  # never failed
    print(f"goodput_rps (attainment >= {TARGET:.0%} at {args.ttft_slo:g} s TTFT / "
          f"{args.tbt_slo * 1e3:g} ms TBT): {'>=' if capped else ''}{good:g}"
          + ("  (every rate passed: raise --rates)" if capped else ""))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "bench": "serve", "target": target, "trace": args.trace,
            "num_prompts": args.num_prompts, "seed": args.seed,
            "scaling": {"prompt_scale": args.prompt_scale, "output_scale": args.output_scale,
                        "max_prompt_len": args.max_prompt_len,
                        "max_output_len": args.max_output_len,
                        "block_len": scaling.block_len, "lengths": lens},
            "ttft_slo_s": args.ttft_slo, "tbt_slo_s": args.tbt_slo, "target_attainment": TARGET,
            "goodput_rps": good, "goodput_capped_by_sweep": capped,
            "rates": {f"{r:g}": m for r, m in per_rate.items()}},
            indent=2))
    return 0
