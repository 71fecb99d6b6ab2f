"""``python -m conflux_jax.bench host-time``: the host's share of a serving iteration.

Many resident decodes on a simulated multi-rank CPU mesh (default: 256 decodes over
``sp=4``, a tiny random Llama, contexts of 300-700 tokens growing as they decode). Two
figures, measured in turn in one process:

- the engine's iteration: ``Engine.step()`` wall time (schedule, host batch, transfer to
  the devices, the compiled forward and sampler, reading the tokens back, commit, output
  processing), median over ``--steps`` decode-only iterations;
- the device's part of it: the same compiled forward and sampler replayed back to back on
  one captured iteration's inputs already on the devices, median.

Their difference is host time per iteration; printed with its share of the iteration.
Three engine loops are measured in turn (``--modes``): async scheduling planning ahead
(the default: the last iteration's outputs, and the plan and host batch of the one after
the next, are built while the device runs the next), async scheduling that plans once the
tokens are in, and one iteration at a time.
The model is tiny on purpose: what is measured is the host work that grows with the
number of requests and their contexts, which a large model on an accelerator pays alike.
"""

from __future__ import annotations

import os

# Simulated CPU devices for the mesh: must precede the first jax import.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402

from conflux_jax.bench.replay import captured_batches, device_times  # noqa: E402
from conflux_jax.config import ModelConfig  # noqa: E402
from conflux_jax.engine import Engine, EngineConfig  # noqa: E402
from conflux_jax.executor.buckets import BucketConfig  # noqa: E402
from conflux_jax.executor.jax_executor import ExecutorConfig  # noqa: E402
from conflux_jax.executor.mesh import MeshSpec  # noqa: E402
from conflux_jax.models.decoder import random_params  # noqa: E402
from conflux_jax.sampling import SamplingParams  # noqa: E402
from conflux_jax.tokenizer import Tokenizer  # noqa: E402

MODEL = ModelConfig(
    architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128,
    num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, rope_theta=500000.0,
    max_position_embeddings=4096, tie_word_embeddings=False, eos_token_ids=(2,))


# The engine loops ``--modes`` names: (async scheduling, planning ahead).
MODES = {"ahead": (True, True), "async": (True, False), "sync": (False, False)}


def build_engine(decodes: int, mesh: str, max_model_len: int,
                 async_scheduling: bool = True, plan_ahead: bool = True) -> Engine:
    n = MeshSpec.parse(mesh).sp
    per_rank = -(-decodes // n)
    pages = per_rank * (-(-max_model_len // 16)) + 64
    ec = ExecutorConfig(mesh=mesh, page_size=16, num_pages=pages, max_model_len=max_model_len,
                        buckets=BucketConfig(tokens=(per_rank, 4 * per_rank),
                                             decode=(per_rank,), transfer=(64,),
                                             max_prefill_seqs=8))
    engine = Engine(MODEL, random_params(MODEL, seed=0), Tokenizer.word_level(MODEL.vocab_size),
                    EngineConfig(executor=ec, calibrate=False, enable_prefix_caching=False,
                                 async_scheduling=async_scheduling, plan_ahead=plan_ahead))
    engine.warmup(progress=False)
    engine.executor.guard.serving = True
    return engine


def measure(decodes: int = 256, mesh: str = "sp=4,tp=1", steps: int = 30,
            max_model_len: int = 1024, seed: int = 0, mode: str = "ahead",
            rounds: int = 3) -> dict[str, Any]:
    """The figures of one engine loop (``mode``, one of ``MODES``). The engine's
    iterations and the device's replays alternate in ``rounds`` blocks (``steps`` of each
    in all), so that a slow spell of a shared host weighs on both; each figure is the
    median over its blocks."""
    engine = build_engine(decodes, mesh, max_model_len, *MODES[mode])
    rng = np.random.default_rng(seed)
    sp = SamplingParams(max_tokens=max_model_len - 700, temperature=0, ignore_eos=True)
    for _ in range(decodes):
        engine.add_request(rng.integers(3, MODEL.vocab_size, int(rng.integers(300, 700)))
                           .tolist(), sp)
    sched = engine.scheduler
    while sched.num_pending or sched.num_decoding < decodes:
        engine.step()
    ex = engine.executor
    for _ in range(5):  # settle
        engine.step()
    with captured_batches(ex) as kept:
        engine.step()
    shape, host = kept[-1]
    assert shape.prefill == 0 and shape.decode >= decodes // ex.num_ranks
    times: list[float] = []
    device: list[float] = []
    per_round = max(1, steps // rounds)
    for _ in range(rounds):
        for _ in range(per_round):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        device += device_times(engine, shape, host, per_round)
    assert sched.num_decoding == decodes, "a request finished inside the timed steps"
    step_s, device_s = statistics.median(times), statistics.median(device)
    host_s = max(0.0, step_s - device_s)
    return {"decodes": decodes, "mesh": mesh, "steps": len(times), "shape": str(shape),
            "mode": mode, "async_scheduling": MODES[mode][0], "plan_ahead": MODES[mode][1],
            "step_ms": 1e3 * step_s, "device_ms": 1e3 * device_s, "host_ms": 1e3 * host_s,
            "host_share": host_s / step_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m conflux_jax.bench host-time",
                                 description="The host's share of a serving iteration at "
                                             "many resident decodes.")
    ap.add_argument("--decodes", type=int, default=256, help="resident decodes")
    ap.add_argument("--mesh", default="sp=4,tp=1", help="simulated CPU mesh")
    ap.add_argument("--steps", type=int, default=30, help="timed iterations")
    ap.add_argument("--modes", nargs="+", choices=tuple(MODES), default=list(MODES),
                    help="engine loops to measure, in turn: async scheduling planning "
                         "ahead (the default), async scheduling planning once the tokens "
                         "are in, one iteration at a time")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    results = []
    for mode in args.modes:
        r = measure(args.decodes, args.mesh, args.steps, mode=mode)
        results.append(r)
        print(f"{r['decodes']} resident decodes on {r['mesh']}, {mode}: iteration "
              f"{r['step_ms']:.2f} ms, device {r['device_ms']:.2f} ms, host "
              f"{r['host_ms']:.2f} ms ({100 * r['host_share']:.0f}% of the iteration)",
              flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
