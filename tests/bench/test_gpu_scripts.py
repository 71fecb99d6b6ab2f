"""The GPU session's scripts run their same code path on CPU (``--shape tiny``), so a change
to the engine cannot break them unnoticed before the next GPU session (device minutes
are few: a script that fails there wastes them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def gpu_profile():
    sys.path.insert(0, str(BENCH))
    try:
        import gpu_profile

        yield gpu_profile
    finally:
        sys.path.remove(str(BENCH))


def test_gpu_profile_runs_both_phases_and_names_the_ops_behind_its_kernels(
        gpu_profile, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    assert gpu_profile.main(["--shape", "tiny", "--json", str(out), "--top", "8"]) == 0
    result = json.loads(out.read_text())
    decode, mixed = result["phases"]["decode"], result["phases"]["mixed"]
    # Every request ran to its length (ignore_eos), untraced and traced alike.
    assert decode["output_tokens"] == 64 * 24 and mixed["output_tokens"] == 16 * 8
    assert decode["steps"] >= 24 and mixed["steps"] >= 8
    tops = [t for phase in (decode, mixed) for line in phase["lines"].values()
            for t in line["top"]]
    assert tops and all(t["ms"] >= 0 and t["count"] > 0 for t in tops)
    # Some of the busiest events are the step's own HLO instructions, named by their ops.
    assert any(any("_rank_forward" in op for op in t["ops"]) for t in tops)
