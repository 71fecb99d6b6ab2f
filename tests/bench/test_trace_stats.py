"""bench/trace_stats.py: the reusable-prefix share against a brute-force prefix search."""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from trace_stats import BLOCK_TOKENS, reusable_prefix_share  # noqa: E402


def _brute_force(rows: list[dict]) -> float:
    """For each request, the longest leading block run equal to the leading run of some
    earlier request's blocks, found by comparing against every earlier prompt's every
    block position (a block reused from any earlier prompt counts, as with a radix
    cache)."""
    total = reused = 0
    for i, row in enumerate(rows):
        earlier = {h for prev in rows[:i] for h in prev["hash_ids"]}
        lead = next((k for k, h in enumerate(row["hash_ids"]) if h not in earlier),
                    len(row["hash_ids"]))
        total += row["input_length"]
        reused += min(row["input_length"], lead * BLOCK_TOKENS)
    return reused / total


def test_reusable_prefix_share_matches_brute_force() -> None:
    rng = random.Random(0)
    rows = []
    for _ in range(60):
        n = rng.randint(1, 6)
        ids = [rng.randrange(12) for _ in range(n)]  # few ids: plenty of reuse
        rows.append({"hash_ids": ids, "input_length": n * BLOCK_TOKENS - rng.randrange(300)})
    share = reusable_prefix_share(rows)
    assert share == _brute_force(rows)
    assert 0 < share < 1


def test_no_reuse_and_full_reuse() -> None:
    fresh = [{"hash_ids": [i], "input_length": BLOCK_TOKENS} for i in range(5)]
    assert reusable_prefix_share(fresh) == 0.0
    same = [{"hash_ids": [7, 8], "input_length": 2 * BLOCK_TOKENS}] * 4
    assert reusable_prefix_share(same) == 0.75  # all but the first request's blocks
