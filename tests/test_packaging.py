"""The wheel as users get it: built from this tree, installed into a fresh venv (no editable
install in sight), its CLIs run from outside the checkout.

The fresh venv gets the dependencies by a ``.pth`` path line naming the dev venv's
site-packages. A path line only appends that folder to ``sys.path``; the ``.pth`` files
inside it (the editable install's finder among them) are not run, so every import of our
packages must come from the installed wheel.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("conflux_jax", "serving", "pallas_kernels")
COEFFS_GLOB = "conflux_jax/*coeffs/*.json"  # fnmatch's * spans folders: any package depth

# Local state of a checkout, never part of a build (the default store can hold 340 MB).
_TOP_LEVEL_STATE = {".git", ".venv", "build", "dist", "checkpoints", "out", ".whl"}
_ANYWHERE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".pytest_cache",
                                   ".ruff_cache", ".hypothesis")

pytestmark = pytest.mark.timeout(300)


@dataclass(frozen=True)
class Installed:
    wheel: Path
    venv: Path
    python: Path
    site_packages: Path
    outside: Path  # a working directory outside the checkout
    env: dict[str, str]

    def run(self, *cmd: str | Path, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(c) for c in cmd], cwd=self.outside, env={**self.env, **env},
                              capture_output=True, text=True, timeout=180)


def _ignore_local_state(folder: str, names: list[str]) -> set[str]:
    skip = set(_ANYWHERE(folder, names))
    if Path(folder) == REPO:
        skip |= _TOP_LEVEL_STATE & set(names)
    return skip


def _can_build_without_isolation() -> bool:
    """setuptools as new as pyproject.toml asks for; since 70.1 it builds wheels itself, so
    the ``wheel`` package is not needed."""
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


def _check(res: subprocess.CompletedProcess[str]) -> str:
    assert res.returncode == 0, f"{res.args} exited {res.returncode}:\n{res.stdout}{res.stderr}"
    return res.stdout


def _pip(*args: str | Path, cwd: Path) -> None:
    _check(subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q",
                           *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=240))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("packaging")
    # Build from a copy: a build in the checkout writes build/ and *.egg-info there, which
    # other runs in the same tree would race on.
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_ignore_local_state, symlinks=True)
    wheel_dir = tmp / "wheels"
    # Without isolation the build uses this venv's setuptools (no network); otherwise pip
    # fetches the build requirements into an isolated environment.
    offline = ["--no-build-isolation", "--no-index"] if _can_build_without_isolation() else []
    _pip("wheel", "--no-deps", *offline, "-w", wheel_dir, src, cwd=tmp)
    (wheel,) = wheel_dir.glob("conflux_jax-*.whl")

    venv = tmp / "venv"
    _check(subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                          capture_output=True, text=True, timeout=120))
    python = venv / "bin" / "python"
    # The dev venv's pip installs into the fresh interpreter (no pip bootstrap there).
    _pip("--python", python, "install", "--no-deps", "--no-index", wheel, cwd=tmp)
    site = Path(_check(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, timeout=60)).strip())
    dev_dirs = dict.fromkeys([sysconfig.get_path("purelib"), sysconfig.get_path("platlib")])
    (site / "zz_dev_dependencies.pth").write_text("".join(f"{d}\n" for d in dev_dirs))

    outside = tmp / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "CONFLUX_CHECKPOINT_DIR")}
    env.update(PYTHONNOUSERSITE="1", XDG_CACHE_HOME=str(tmp / "xdg"))
    return Installed(wheel, venv, python, site, outside, env)


def test_wheel_holds_the_packages_and_their_data_only(installed: Installed) -> None:
    names = zipfile.ZipFile(installed.wheel).namelist()
    tops = {n.split("/")[0] for n in names if "/" in n}
    assert set(PACKAGES) <= tops
    assert not tops & {"tests", "bench", "checkpoints", "examples", "scripts"}
    # Every module and every shipped latency fit of the source tree, wherever they sit.
    want_py = {p.relative_to(REPO).as_posix() for pkg in PACKAGES
               for p in (REPO / pkg).rglob("*.py") if "__pycache__" not in p.parts}
    assert want_py <= set(names), sorted(want_py - set(names))
    jsons = [p.relative_to(REPO).as_posix() for p in REPO.glob("conflux_jax/**/*.json")]
    want_coeffs = set(fnmatch.filter(jsons, COEFFS_GLOB))
    assert want_coeffs, "no conflux_jax/**/coeffs/*.json in the source tree"
    assert want_coeffs == set(fnmatch.filter(names, COEFFS_GLOB))
    # C++ sources compiled on first use (the CPU GEMM) ship with their modules.
    want_cc = {p.relative_to(REPO).as_posix() for p in (REPO / "pallas_kernels").rglob("*.cc")}
    assert want_cc and want_cc <= set(names), sorted(want_cc - set(names))


def test_imports_come_from_the_wheel_not_the_checkout(installed: Installed) -> None:
    code = ("import json, sys, conflux_jax, serving, pallas_kernels; "
            "print(json.dumps({'files': [m.__file__ for m in (conflux_jax, serving, "
            "pallas_kernels)], 'editable': [m for m in sys.modules if 'editable' in m]}))")
    got = json.loads(_check(installed.run(installed.python, "-c", code)))
    for file in got["files"]:
        assert Path(file).is_relative_to(installed.site_packages), file
    assert got["editable"] == []  # the dev install's finder never ran


@pytest.mark.parametrize(("name", "option"), [("kernels", "--gpu-dry-run"),
                                              ("executor", "--startup")])
def test_bench_subcommands_run_from_the_wheel(installed: Installed, name: str,
                                              option: str) -> None:
    out = _check(installed.run(installed.python, "-m", "conflux_jax.bench", name, "--help"))
    assert option in out


def test_conflux_serve_entry_point(installed: Installed) -> None:
    out = _check(installed.run(installed.venv / "bin" / "conflux-serve", "--help"))
    assert "--checkpoint-dir" in out and "--model" in out


def test_installed_copy_keeps_checkpoints_in_the_user_cache(installed: Installed) -> None:
    code = ("from conflux_jax.checkpoints.default_model import resolve_store; "
            "s = resolve_store(); print(s.path); print(s.reason)")
    path, reason = _check(installed.run(installed.python, "-c", code)).splitlines()
    assert (Path(path), reason) == \
        (Path(installed.env["XDG_CACHE_HOME"]) / "conflux_jax" / "checkpoints", "user cache")
