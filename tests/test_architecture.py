"""The layered architecture (pyproject's import-linter contract) holds, and the contract
really catches a back edge: a copy of the tree with one upward import fails it."""

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"
PACKAGES = ("conflux_jax", "serving", "pallas_kernels")


def _lint(root: Path) -> subprocess.CompletedProcess:
    # PYTHONPATH first: the copy under test, not the installed (editable) packages.
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(root)}
    return subprocess.run([str(LINT), "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_layers_contract_holds():
    res = _lint(REPO)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "1 kept, 0 broken" in res.stdout


def test_a_back_edge_breaks_the_contract(tmp_path):
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    plan = tmp_path / "conflux_jax" / "plan.py"  # the bottom layer reaching up
    plan.write_text(plan.read_text() + "\nimport conflux_jax.scheduler.scheduler  # noqa\n")
    res = _lint(tmp_path)
    assert res.returncode != 0
    assert "BROKEN" in res.stdout
    assert "conflux_jax.plan -> conflux_jax.scheduler.scheduler" in res.stdout
