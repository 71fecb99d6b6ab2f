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
* Multi-turn replay (``multi_turn``): consecutive rows become the turns of one chat; a
  follow-up turn resends the whole conversation so far (earlier prompt, the answer the
  server gave, a new user message) once the previous turn has finished, as a chat client
  does. That resent history is what a prefix cache can reuse; ``reusable_tokens`` counts
  it by brute force.
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
    """One request. A follow-up turn (``follows`` = the index of the previous turn in the
    replay) is sent once that turn has finished, and not before ``arrival_s``; its prompt
    is the previous turn's prompt, the tokens the server generated, then ``prompt_ids``."""

    arrival_s: float  # offset from the start of the run
    prompt_ids: list[int]
    max_tokens: int
    follows: int | None = None


def full_prompt(reqs: list[ServeRequest], i: int, sent: dict[int, list[int]],
                outputs: dict[int, list[int]]) -> list[int]:
    """The prompt request ``i`` sends, given what earlier turns sent and got back."""
    r = reqs[i]
    if r.follows is None:
        return list(r.prompt_ids)
    return sent[r.follows] + outputs[r.follows] + list(r.prompt_ids)


def multi_turn(rows: list[Row], turns: int, scaling: LengthScaling,
               turn_scaling: LengthScaling, vocab: tuple[int, int], seed: int | str = 0
               ) -> list[ServeRequest]:
    """Chats of ``turns`` consecutive rows: the first turn is the row's synthesized
    prompt (``scaling``); each later turn adds a new user message of its row's length
    scaled by ``turn_scaling`` to the conversation so far. Outputs use ``scaling``."""
    first = synthesize(rows, scaling, vocab, seed)
    out: list[ServeRequest] = []
    for k, (row, req) in enumerate(zip(rows, first, strict=True)):
        if k % turns == 0:
            out.append(req)
            continue
        rng = random.Random(f"{seed}/turn/{k}")
        msg = [rng.randrange(*vocab) for _ in range(turn_scaling.prompt(row.input_len))]
        out.append(ServeRequest(row.arrival_s, msg, req.max_tokens, follows=k - 1))
    return out


def reusable_tokens(sent: list[list[int]], outputs: list[list[int]], page_size: int,
                    pool_pages: int | None = None) -> int:
    """Prompt tokens a prefix cache could serve, by brute force over the requests in the
    order they were sent: each request's longest run of full pages (leaving its last
    token to compute) that an earlier request's KV (its prompt and all but its last
    generated token) holds. With ``pool_pages``, earlier KV is kept in an LRU of that
    many pages, touched on every use (what a pool of that size can keep at best)."""
    from collections import OrderedDict

    lru: OrderedDict[tuple[int, ...], None] = OrderedDict()
    total = 0
    for prompt, out in zip(sent, outputs, strict=True):
        hit = 0
        while (hit + 1) * page_size <= len(prompt) - 1 and \
                tuple(prompt[:(hit + 1) * page_size]) in lru:
            hit += 1
        total += hit * page_size
        kv = prompt + out[:-1]
        for j in range(1, len(kv) // page_size + 1):
            lru[tuple(kv[:j * page_size])] = None
            lru.move_to_end(tuple(kv[:j * page_size]))
        while pool_pages is not None and len(lru) > pool_pages:
            lru.popitem(last=False)
    return total


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
               seed: int | str = 0) -> list[ServeRequest]:
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
