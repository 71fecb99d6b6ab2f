"""Make the shared test helpers (tests/tiny_models.py, tests/checkpoints/) importable."""

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
for extra in (TESTS, TESTS / "checkpoints"):
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))
