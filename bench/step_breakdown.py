"""Where a serving step's time goes: the same step compiled with parts of it taken out.

    python bench/step_breakdown.py [--concurrency 16] [--json PATH]

Runs ``bench compare``'s two workloads through the in-process engine (default model, one
host device) and keeps one real step of each: a decode step of every request (decode-heavy
workload, 32-token prompts, late in the run) and a full prefill chunk co-batched with
decodes (prefill-heavy, 128-token prompts). Each is then compiled again with parts of the
step replaced, and timed on the same arrays (fastest of ``--repeats``):

- ``no attention``: both attention calls return their queries (the linears still run);
- ``no KV write``: the K/V scatters into the pool are skipped;
- ``neither``: both;
- ``full, rpa attention``: where attention runs the CPU's FFI handlers, the full step with
  the ragged paged attention kernel's XLA form in their place, timed in turn with the full
  step once more (``full, A/B``);
- ``full, XLA's dot``: where the linears run the packed GEMM, the full step with XLA's dot
  on the plain weights in its place, timed in turn (``full, A/B linears``).

Beside them, the dense layers alone on as many rows, with the LM head when every row
samples (``conflux_jax.bench.dense_bound``). The differences say what attention and the KV writes
cost inside the real step; what remains over the dense figure is sampling, the buffer
gathers and scatters around attention, and the step's fixed work.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax

import conflux_jax.executor.step as step_module
from conflux_jax.bench.compare import make_prompts
from conflux_jax.bench.dense_bound import dense_seconds
from conflux_jax.bench.replay import captured_batches
from conflux_jax.bench.serve import engine_from_model, run_engine
from conflux_jax.bench.serve_workload import ServeRequest
from conflux_jax.checkpoints import load_checkpoint
from conflux_jax.executor.batch import StepBatch


def capture(engine: Any, prompt_len: int, max_tokens: int, concurrency: int,  # noqa: ANN401
            want: Any) -> tuple[Any, StepBatch] | None:  # noqa: ANN401
    """Run the workload once and return the last step (shape, host batch) that ``want``
    accepts, or None when it ran none (one request never co-batches a prefill)."""
    prompts = make_prompts(concurrency, prompt_len, engine.model_config.vocab_size, 0)
    with captured_batches(engine.executor, want) as kept:
        run_engine(engine, [ServeRequest(0.0, p, max_tokens) for p in prompts])
    return kept[-1] if kept else None


@contextlib.contextmanager
def without(attention: bool, kv_write: bool) -> Iterator[None]:
    """Build steps with attention (returns q) and/or the KV scatters (pool unchanged)
    taken out."""
    names = ("ragged_paged_attention", "paged_decode", "paged_prefill")
    saved = [getattr(step_module, n) for n in (*names, "_write_stacked")]
    if attention:
        for name in names:
            setattr(step_module, name, lambda q, *a, **k: q)
    if kv_write:
        step_module._write_stacked = lambda pool, *a: pool
    try:
        yield
    finally:
        for name, fn in zip((*names, "_write_stacked"), saved, strict=True):
            setattr(step_module, name, fn)


def time_steps(ex: Any, shape: Any, host: StepBatch, repeats: int,  # noqa: ANN401
               configs: list[dict[str, Any]], params: list[Any] | None = None) -> list[float]:
    """Fastest of ``repeats`` runs of freshly built and compiled steps on ``host``, one per
    ``configs`` entry (``StepConfig`` fields to change; ``params``: each one's weights,
    default the executor's), run in turn so that a slow spell of the machine falls on all
    of them."""
    weights = params or [ex.params] * len(configs)
    inputs = ex.device_inputs(host)
    _, *rest = ex._abstract_args(shape)
    forwards = [step_module.build_step(dataclasses.replace(ex.step_config, **cfg), ex.mesh,
                                       step_module.param_specs(w)).forward
                .lower(jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                                   sharding=a.sharding), w),
                       *rest).compile() for cfg, w in zip(configs, weights, strict=True)]
    ex.compile_shape(shape)  # the sampler of the shape's row count (no config changes it)
    sampler = ex._samplers[StepBatch.sample_rows(shape, ex.layout)]
    best = [float("inf")] * len(configs)
    for i in range(repeats + 1):  # the first round is a warm-up
        for j, forward in enumerate(forwards):
            start = time.perf_counter()
            out = forward(weights[j], ex.kv_pools, *inputs.forward)
            ex.kv_pools = out.kv_pools
            jax.block_until_ready(sampler(out.logits, inputs.sample))
            if i:
                best[j] = min(best[j], time.perf_counter() - start)
    return best


def time_step(ex: Any, shape: Any, host: StepBatch, repeats: int) -> float:  # noqa: ANN401
    """Fastest of ``repeats`` runs of a freshly built and compiled step on ``host``."""
    return time_steps(ex, shape, host, repeats, [{}])[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    c = args.concurrency
    engine = engine_from_model("default", 512, "conflux", 60.0, 10.0)
    ex = engine.executor
    steps = {
        # Mid-run: the requests' contexts are ~100 tokens (32 prompt + ~70 generated).
        "decode": capture(engine, 32, 128, c, lambda plan: not plan.prefill and len(
            plan.decode) == c and min(d.position + 1 for d in plan.decode) <= 100),
        "prefill+decode": capture(engine, 128, 32, c, lambda plan: bool(plan.prefill) and sum(
            p.length for p in plan.prefill) >= 200 and bool(plan.decode)),
    }
    ckpt = load_checkpoint("default")
    params = jax.device_put(ckpt.params)
    # One host device: no head padding, so the checkpoint's weights are the plain ones.
    plain = params
    report: dict[str, dict[str, Any]] = {}
    for name, step in steps.items():
        if step is None:
            print(f"(no {name} step at concurrency {c})")
            continue
        shape, host = step
        prefill = int(host.shared.cu_q_lens[-1])
        live = prefill + int(host.rank.num_decode.sum())
        row: dict[str, Any] = {"shape": str(shape), "live_tokens": live}
        dense = "dense layers + LM head" if not prefill else "dense layers"
        for label, (attn, kv) in {"full step": (False, False), "no attention": (True, False),
                                  "no KV write": (False, True),
                                  "neither": (True, True)}.items():
            with without(attn, kv):
                row[label] = time_step(ex, shape, host, args.repeats)
        # What the CPU's attention handlers spare, the kernel's XLA form in their place.
        rpa = {f"{k}_attention": "rpa" for k in ("decode", "prefill")
               if getattr(ex.step_config, f"{k}_attention") != "rpa"}
        if rpa:
            row["full, A/B"], row["full, rpa attention"] = time_steps(
                ex, shape, host, args.repeats, [{}, rpa])
        # What the packed GEMM spares: XLA's dot on the plain weights in its place.
        if ex.step_config.linears == "packed":
            row["full, A/B linears"], row["full, XLA's dot"] = time_steps(
                ex, shape, host, args.repeats, [{}, {"linears": "xla"}], [ex.params, plain])
        # A decode step samples every row; a prefill step only the rows that finish a
        # prompt and the decodes, so its LM head is left out of the comparison.
        row[dense] = dense_seconds(ckpt.config, params, live, not prefill, args.repeats)
        report[name] = row
    print(f"SmolLM2-135M fp32, one host device, {c} requests; fastest of {args.repeats} "
          "runs, ms")
    for name, row in report.items():
        print(f"\n{name} step: {row['shape']}, {row['live_tokens']} live tokens")
        for label, value in row.items():
            if isinstance(value, float):
                print(f"  {label:<24} {1e3 * value:8.1f}")
        full = row["full step"]
        print(f"  {'attention':<24} {1e3 * (full - row['no attention']):8.1f}  (full - no "
              "attention)")
        print(f"  {'KV writes':<24} {1e3 * (full - row['no KV write']):8.1f}  (full - no KV "
              "write)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bench": "step_breakdown", "concurrency": c,
                                         "repeats": args.repeats, "steps": report}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
