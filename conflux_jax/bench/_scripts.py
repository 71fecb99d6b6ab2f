"""Run a standalone script from the repo's ``bench/`` folder as a bench subcommand."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def load_script(name: str) -> ModuleType:
    path = BENCH_DIR / f"{name}.py"
    if not path.is_file():
        raise SystemExit(f"{path} not found: this subcommand runs from a source checkout")
    spec = importlib.util.spec_from_file_location(f"conflux_bench_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
