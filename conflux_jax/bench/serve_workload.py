"""Replayable serving workloads: trace rows -> scaled lengths -> token-id prompts at a rate.

* Rows come from a Mooncake JSONL trace (by name in ``../shared/traces`` or by path), the
  seeded toolagent-like workload (paper Table 3) or Poisson random lengths.
* Lengths are scaled by one factor and capped (``LengthScaling``) so a CPU can serve
  them; the scaling is recorded in every output.
* Prompts are synthesized as token ids: each trace ``hash_id`` (a 512-token block) maps
  to a fixed pseudo-random block of ``512 * prompt_scale`` tokens, so requests that
  share hash ids share a prompt prefix; a row without hash ids gets unique tokens.
* Arrivals follow §8.1: subsample, then scale every inter-arrival gap by one factor so
  the mean rate hits the target.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from conflux_jax.bench.workloads import poisson_random, toolagent_like, traces_dir

TRACE_BLOCK = 512  # tokens per Mooncake hash id


@dataclasses.dataclass(frozen=True)
class Row:
    arrival_s: float
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class LengthScaling:
    """``len' = clamp(round(len * scale), 1, cap)`` for prompts and outputs."""

    prompt_scale: float = 1.0
    output_scale: float = 1.0
    max_prompt_len: int | None = None
    max_output_len: int | None = None

    def prompt(self, n: int) -> int:
        return _clamp(round(n * self.prompt_scale), self.max_prompt_len)

    def output(self, n: int) -> int:
        return _clamp(round(n * self.output_scale), self.max_output_len)

    @property
    def block_len(self) -> int:
        return max(1, round(TRACE_BLOCK * self.prompt_scale))


def _clamp(n: int, cap: int | None) -> int:
    return max(1, n if cap is None else min(n, cap))


@dataclasses.dataclass(frozen=True)
class ServeRequest:
    arrival_s: float  # offset from the start of the run
    prompt_ids: list[int]
    max_tokens: int


def load_rows(trace: str, num: int, seed: int = 0) -> list[Row]:
    """Base rows of a named workload (arrival times at the trace's own rate)."""
    if trace == "toolagent":
        return [Row(t, p, o) for t, p, o in toolagent_like(num, seed)]
    if trace == "poisson":
        return [Row(t, p, o) for t, p, o in poisson_random(num, seed)]
    path = Path(trace) if trace.endswith(".jsonl") else traces_dir() / f"{trace}_trace.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"trace {path} not found (set CONFLUX_TRACES_DIR)")
    rows = []
    with path.open() as f:
        for line in f:
            if line.strip():
                d = json.loads(line)
                rows.append(Row(d["timestamp"] / 1000.0, int(d["input_length"]),
                                int(d["output_length"]), tuple(d.get("hash_ids", ()))))
    return rows


def at_rate(rows: list[Row], rate: float, num: int, seed: int = 0) -> list[Row]:
    """Subsample ``num`` rows (seeded, order kept), scale gaps to a mean of ``rate`` req/s."""
    if num < len(rows):
        picked = sorted(random.Random(seed).sample(range(len(rows)), num))
        rows = [rows[i] for i in picked]
    t0, span = rows[0].arrival_s, rows[-1].arrival_s - rows[0].arrival_s
    scale = (len(rows) - 1) / rate / span if span > 0 and len(rows) > 1 else 0.0
    return [dataclasses.replace(r, arrival_s=(r.arrival_s - t0) * scale) for r in rows]


def synthesize(rows: list[Row], scaling: LengthScaling, vocab: tuple[int, int],
               seed: int = 0) -> list[ServeRequest]:
    """Token-id prompts of the scaled lengths; shared hash ids -> shared prefixes."""
    lo, hi = vocab
    blocks: dict[int, list[int]] = {}
    out = []
    for k, r in enumerate(rows):
        n = scaling.prompt(r.input_len)
        ids: list[int] = []
        for h in r.hash_ids:
            if len(ids) >= n:
                break
            if h not in blocks:  # the block's content depends only on (seed, hash id)
                rng = random.Random(f"{seed}/block/{h}")
                blocks[h] = [rng.randrange(lo, hi) for _ in range(scaling.block_len)]
            ids.extend(blocks[h])
        rng = random.Random(f"{seed}/req/{k}")
        ids.extend(rng.randrange(lo, hi) for _ in range(max(0, n - len(ids))))
        out.append(ServeRequest(r.arrival_s, ids[:n], scaling.output(r.output_len)))
    return out


def percentiles(values: list[int]) -> dict[str, float]:
    s = sorted(values)
    pick = lambda q: float(s[min(len(s) - 1, int(q * len(s)))])  # noqa: E731
    return {"p50": pick(0.5), "p95": pick(0.95), "max": float(s[-1])}
