"""Request workloads for benchmarks: traces, a toolagent-like synthetic, Poisson random.

Rate scaling follows §8.1: subsample the base workload, then scale every inter-arrival
time by one factor so the mean rate hits the target; cap lengths at the model context.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path

from conflux_jax.scheduler.request import Request

# (arrival seconds, prompt tokens, output tokens)
Base = list[tuple[float, int, int]]

# Paper Table 3, Mooncake-Toolagent: prompt P50 6,346 / P95 26,114; output P50 30 / P95 600.
TOOLAGENT_PROMPT = (6346, 26114)
TOOLAGENT_OUTPUT = (30, 600)
_Z95 = 1.6448536269514722


def traces_dir() -> Path:
    """$CONFLUX_TRACES_DIR, else ``../shared/traces`` beside the repository root."""
    env = os.environ.get("CONFLUX_TRACES_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2].parent / "shared" / "traces"


def load_trace(name: str) -> Base:
    """A Mooncake trace by name ("conversation", "synthetic") or path to a .jsonl file."""
    path = Path(name) if name.endswith(".jsonl") else traces_dir() / f"{name}_trace.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"trace {path} not found (set CONFLUX_TRACES_DIR)")
    out: Base = []
    with path.open() as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                out.append((d["timestamp"] / 1000.0, int(d["input_length"]),
                            int(d["output_length"])))
    return out


def _lognormal(rng: random.Random, p50: float, p95: float) -> float:
    return rng.lognormvariate(math.log(p50), math.log(p95 / p50) / _Z95)


def toolagent_like(num: int, seed: int = 0) -> Base:
    """Seeded lognormal lengths matching Table 3's P50/P95, Poisson arrivals at 1 req/s.

    Lognormal is an assumption: only the two percentiles are published, and a lognormal
    is the two-parameter family that fits both exactly with the observed long tail.
    """
    rng = random.Random(seed)
    t = 0.0
    out: Base = []
    for _ in range(num):
        t += rng.expovariate(1.0)
        out.append((t, max(1, round(_lognormal(rng, *TOOLAGENT_PROMPT))),
                    max(1, round(_lognormal(rng, *TOOLAGENT_OUTPUT)))))
    return out


def poisson_random(num: int, seed: int = 0, prompt: tuple[int, int] = (128, 8192),
                   output: tuple[int, int] = (16, 512)) -> Base:
    """Uniform random lengths, Poisson arrivals at 1 req/s."""
    rng = random.Random(seed)
    t = 0.0
    out: Base = []
    for _ in range(num):
        t += rng.expovariate(1.0)
        out.append((t, rng.randint(*prompt), rng.randint(*output)))
    return out


def at_rate(base: Base, rate: float, num: int, max_context: int, seed: int = 0) -> list[Request]:
    """Subsample ``num`` requests, rescale arrivals to ``rate`` req/s, cap lengths."""
    if num < len(base):
        rng = random.Random(seed)
        picked = sorted(rng.sample(range(len(base)), num))
        base = [base[i] for i in picked]
    t0 = base[0][0]
    span = base[-1][0] - t0
    scale = (len(base) - 1) / rate / span if span > 0 and len(base) > 1 else 1.0
    reqs = []
    for i, (t, p, o) in enumerate(base):
        p = min(p, max_context - 1)
        o = max(1, min(o, max_context - p))
        reqs.append(Request(i, (t - t0) * scale, p, o))
    return reqs


def load_workload(name: str, num: int, seed: int = 0) -> Base:
    """"toolagent" (synthetic, Table 3), "poisson", or a trace name / path."""
    if name == "toolagent":
        return toolagent_like(num, seed)
    if name == "poisson":
        return poisson_random(num, seed)
    return load_trace(name)
