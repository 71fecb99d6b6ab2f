"""Where an accelerator step's time goes: a JAX profiler trace of the serving engine on
random Llama-3.1-8B-shaped bf16 weights, summarised on the device (no trace to carry back).

    python bench/gpu_profile.py --json PATH [--shape tiny]

Two phases, each run untraced (its wall time) and then traced, after warm-up: ``decode``
(64 requests of 32-token prompts, 24 tokens each: mostly 64-row decode steps) and
``mixed`` (16 prompts of 1-2K tokens, 8 tokens each: 512-token prefill chunks co-batched
with decodes). For each phase: wall time, engine steps, the device's busy time per trace
line (wall - busy is host time the device waited for; the trace runs without the Python
tracer, which slowed the host several-fold in the first GPU run) and the kernels that
took the most device time, each with the JAX ops it was compiled from. Downloads and
installs nothing; ``--shape tiny`` smoke-tests the same path on CPU.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import logging
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_serve import LLAMA_8B, TINY, random_device_params, word_tokenizer  # noqa: E402


def summarise(trace_dir: str, top: int) -> dict[str, Any]:
    """Device busy time per trace line and the top kernels by total time, from the
    xplane the profiler wrote (device planes; the host's XLA threads on a CPU backend)."""
    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    pd = ProfileData.from_file(files[0])
    planes = [p for p in pd.planes if p.name.startswith("/device:")] or \
        [p for p in pd.planes if p.name == "/host:CPU"]
    lines: dict[str, Any] = {}
    for plane in planes:
        for line in plane.lines:
            if line.name == "python":
                continue
            by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
            busy = 0.0
            for ev in line.events:
                ms = ev.duration_ns / 1e6
                busy += ms
                by_name[ev.name][0] += ms
                by_name[ev.name][1] += 1
            if not by_name:
                continue
            ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
            lines[f"{plane.name} {line.name}"] = {
                "busy_ms": round(busy, 3), "events": sum(c for _, c in by_name.values()),
                "top": [{"name": n[:160], "ms": round(ms, 3), "count": c}
                        for n, (ms, c) in ranked]}
    return lines


def hlo_ops(engine: Any) -> dict[str, list[str]]:  # noqa: ANN401
    """Each instruction name of the compiled step executables -> the JAX ops it came from
    (the HLO metadata's op_name): what a kernel in the trace is, in the model's terms."""
    found: dict[str, set[str]] = collections.defaultdict(set)
    ex = engine.executor
    for exe in (*ex._compiled.values(), *ex._samplers.values()):
        for line in exe.as_text().splitlines():
            m = HLO_LINE.match(line)
            if m:
                # The trace names an instruction `fusion_3` where the HLO text says
                # `fusion.3`: both spellings map to its ops.
                for name in {m.group(1), m.group(1).replace(".", "_")}:
                    found[name].add(m.group(2))
    return {k: sorted(v)[:3] for k, v in found.items()}


HLO_LINE = re.compile(r'\s*(?:ROOT )?%([\w.\-]+) = .*?metadata=\{op_name="([^"]+)"')


def run_phase(engine: Any, name: str, prompts: list[list[int]], max_tokens: int,
              top: int, ops: dict[str, list[str]]) -> dict[str, Any]:
    import jax

    from conflux_jax import SamplingParams

    sp = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)] * len(prompts)
    engine.generate(prompts[:2], sp[:2])  # anything lazy happens outside the trace
    # Untraced first: the wall time to compare the device's busy time with (a trace's own
    # host work would inflate it; the Python tracer most of all, so it stays off).
    t0 = time.perf_counter()
    engine.generate(prompts, sp)
    untraced = time.perf_counter() - t0
    ex, steps = engine.executor, [0]
    launch = ex.launch  # how the engine starts each step

    def counted(*a: Any, **k: Any) -> Any:  # noqa: ANN401
        steps[0] += 1
        return launch(*a, **k)

    ex.launch = counted
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    trace_dir = tempfile.mkdtemp(prefix=f"conflux_{name}_")
    with jax.profiler.trace(trace_dir, profiler_options=options):
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sp)
        wall = time.perf_counter() - t0
    del ex.launch
    tokens = [len(o.outputs[0].token_ids) for o in outs]
    lines = summarise(trace_dir, top)
    for v in lines.values():
        for t in v["top"]:
            t["ops"] = ops.get(t["name"], [])
    result = {"wall_ms": round(1e3 * untraced, 3), "traced_wall_ms": round(1e3 * wall, 3),
              "requests": len(prompts),
              "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(tokens),
              "steps": steps[0], "lines": lines}
    busiest = max((v["busy_ms"] for v in result["lines"].values()), default=0.0)
    print(f"{name}: wall {1e3 * untraced:.1f} ms ({1e3 * wall:.1f} ms traced) over "
          f"{steps[0]} steps, busiest device line {busiest:.1f} ms",
          flush=True)
    for line, v in result["lines"].items():
        print(f"  {line}: busy {v['busy_ms']:.1f} ms over {v['events']} events", flush=True)
        for t in v["top"][:12]:
            print(f"    {t['ms']:9.2f} ms x{t['count']:<5d} {t['name'][:60]}  "
                  f"{'; '.join(t['ops'])[:120]}", flush=True)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--shape", choices=["llama3.1-8b", "tiny"], default="llama3.1-8b")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("jax", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)

    import jax

    from conflux_jax.config import ModelConfig, RopeScaling
    from conflux_jax.engine import Engine, EngineConfig
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig

    shape = LLAMA_8B if args.shape == "llama3.1-8b" else TINY
    cfg = ModelConfig(**shape, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192))
    params = random_device_params(cfg)
    jax.block_until_ready(params)
    max_len = 4096
    buckets = BucketConfig(tokens=(64, 512), decode=(64,), transfer=(max_len // 16,),
                           max_prefill_seqs=8)
    ec = ExecutorConfig(mesh="sp=1,tp=1", max_model_len=max_len, buckets=buckets,
                        num_pages=16384)
    engine = Engine(cfg, params, word_tokenizer(cfg.vocab_size),
                    EngineConfig(executor=ec, calibrate=False))
    del params
    t0 = time.perf_counter()
    engine.warmup(progress=False)
    result: dict[str, Any] = {"device": engine.executor.device_kind,
                              "warmup_s": time.perf_counter() - t0, "phases": {}}
    rng = np.random.default_rng(0)
    phases = {
        "decode": ([rng.integers(3, cfg.vocab_size, 32).tolist() for _ in range(64)], 24),
        "mixed": ([rng.integers(3, cfg.vocab_size, int(n)).tolist()
                   for n in rng.integers(1024, 2049, 16)], 8),
    }
    ops = hlo_ops(engine)
    for name, (prompts, max_tokens) in phases.items():
        result["phases"][name] = run_phase(engine, name, prompts, max_tokens, args.top, ops)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
