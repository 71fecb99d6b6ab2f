"""conflux_jax.bench.workloads: prefix-cache hits from Mooncake hash ids."""

from __future__ import annotations

import json
import random

import pytest

from conflux_jax.bench.workloads import (
    TRACE_BLOCK_TOKENS,
    at_rate,
    cached_prefixes,
    load_trace,
    load_trace_hashes,
)


def _brute_force(hashes: list[list[int]], prompts: list[int]) -> list[int]:
    """Per request: the longest k such that each of its first k blocks occurs in some
    earlier request (tried for every k from the longest down), capped at prompt - 1."""
    out = []
    for i, (ids, p) in enumerate(zip(hashes, prompts, strict=True)):
        earlier = [h for prev in hashes[:i] for h in prev]
        k = next(k for k in range(len(ids), -1, -1) if all(h in earlier for h in ids[:k]))
        out.append(min(p - 1, k * TRACE_BLOCK_TOKENS))
    return out


def test_cached_prefixes_match_brute_force() -> None:
    rng = random.Random(0)
    hashes, prompts = [], []
    for _ in range(80):
        n = rng.randint(1, 6)
        hashes.append([rng.randrange(15) for _ in range(n)])  # few ids: plenty of reuse
        prompts.append(n * TRACE_BLOCK_TOKENS - rng.randrange(TRACE_BLOCK_TOKENS))
    got = cached_prefixes(hashes, prompts)
    assert got == _brute_force(hashes, prompts)
    assert 0 < sum(got) < sum(prompts)


def test_a_repeated_prompt_keeps_its_last_token_to_compute() -> None:
    assert cached_prefixes([[1, 2], [1, 2], [3]], [1024, 1024, 5]) == [0, 1023, 0]


def test_at_rate_caches_only_what_sampled_requests_sent(tmp_path) -> None:
    rows = [{"timestamp": 1000 * i, "input_length": 2 * TRACE_BLOCK_TOKENS,
             "output_length": 4, "hash_ids": [7, 100 + i]} for i in range(40)]
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    base, hashes = load_trace(str(path)), load_trace_hashes(str(path))
    named = at_rate(base, 2.0, 10, 100_000, seed=3, hashes=hashes)
    # by default the requests name their blocks for the engine's (bounded) cache
    assert all(r.cached_prefix == 0 and r.block_tokens == TRACE_BLOCK_TOKENS for r in named)
    assert {r.block_ids[0] for r in named} == {7} and len({r.block_ids for r in named}) == 10
    reqs = at_rate(base, 2.0, 10, 100_000, seed=3, hashes=hashes, unbounded_cache=True)
    # the unbounded upper bound: block 7 is shared by all; the second block is unique: the
    # first sampled request prefills everything, every later one has one block cached.
    assert [r.cached_prefix for r in reqs] == [0] + [TRACE_BLOCK_TOKENS] * 9
    plain = at_rate(base, 2.0, 10, 100_000, seed=3)
    assert [(r.arrival_s, r.prompt_len) for r in plain] == \
        [(r.arrival_s, r.prompt_len) for r in reqs]  # the same sample either way
    assert all(r.cached_prefix == 0 for r in plain)
    # a cap below the cached run still leaves one token to prefill
    short = at_rate(base, 2.0, 10, 300, seed=3, hashes=hashes, unbounded_cache=True)
    assert all(r.cached_prefix == (0 if i == 0 else r.prompt_len - 1)
               for i, r in enumerate(short))


def test_trace_without_hashes_is_refused(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps({"timestamp": 0, "input_length": 5, "output_length": 1}))
    with pytest.raises(ValueError, match="hash_ids"):
        load_trace_hashes(str(path))
