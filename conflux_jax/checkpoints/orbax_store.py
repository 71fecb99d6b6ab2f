"""Our native checkpoint format: one self-contained directory.

::

    DIR/
      conflux_checkpoint.json   marker + provenance; written last, so a dir without it
                                is not a (complete) checkpoint
      config.json               ModelConfig.to_dict()
      tokenizer.json            tokenizer (HF format) ...
      tokenizer_config.json     ... with its special ids and chat template
      params/                   orbax PyTree checkpoint of the Params tree

Writes go to a hidden sibling directory that is renamed into place at the end, so an
interrupted or concurrent writer never leaves a half-written checkpoint at ``DIR``.
Restores read shapes and dtypes from orbax's metadata, so no template is needed.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp

from conflux_jax.checkpoints.layout import cast_params, dtype_name, iter_leaves
from conflux_jax.config import ConfigError, ModelConfig
from conflux_jax.models.params import CheckpointError, Params, validate_params
from conflux_jax.tokenizer import Tokenizer, TokenizerError

MARKER_FILE = "conflux_checkpoint.json"
CONFIG_FILE = "config.json"
PARAMS_DIR = "params"
FORMAT = "conflux_jax.orbax"
FORMAT_VERSION = 1


class CheckpointExistsError(CheckpointError):
    """The destination of a save already holds something."""


def is_orbax_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / MARKER_FILE).is_file()


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _to_numpy(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    return np.asarray(tree)  # device arrays are copied to host; orbax restores numpy


def save_orbax(dst: str | Path, config: ModelConfig, params: Params, tokenizer: Tokenizer,
               *, source: str = "", overwrite: bool = False) -> Path:
    """Write a checkpoint directory at ``dst`` (atomically); returns its absolute path.

    ``params`` are saved in the dtype they have (e.g. all f32 or all bf16). Raises
    ``CheckpointExistsError`` if ``dst`` exists and ``overwrite`` is false.
    """
    dst = Path(dst).expanduser().absolute()
    if dst.exists() and not overwrite and not _is_empty_dir(dst):
        raise CheckpointExistsError(f"{dst}: already exists")
    validate_params(config, params, source or str(dst))
    params = _to_numpy(params)
    dtypes = sorted({dtype_name(a.dtype) for _, a in iter_leaves(params)})
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        (tmp / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
        tokenizer.save(tmp)
        # Synchronous checkpointer: no background commit thread outliving the call.
        with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ckptr:
            ckptr.save(tmp / PARAMS_DIR, args=ocp.args.StandardSave(params))
        marker = {"format": FORMAT, "version": FORMAT_VERSION, "source": source,
                  "dtype": dtypes[0] if len(dtypes) == 1 else dtypes}
        (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2))
        if overwrite and dst.exists():
            shutil.rmtree(dst)
        try:
            os.rename(tmp, dst)  # atomic; fails if another writer got there first
        except OSError:
            if dst.exists():
                raise CheckpointExistsError(f"{dst}: already exists") from None
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dst


def read_marker(path: Path) -> dict[str, Any]:
    marker_path = path / MARKER_FILE
    try:
        marker = json.loads(marker_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{marker_path}: unreadable checkpoint marker ({e})") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT:
        raise CheckpointError(f"{marker_path}: not a {FORMAT} checkpoint marker")
    if int(marker.get("version", 0)) > FORMAT_VERSION:
        raise CheckpointError(f"{marker_path}: checkpoint format version "
                              f"{marker.get('version')} is newer than supported "
                              f"({FORMAT_VERSION})")
    return marker


def _restore_args(meta: Any) -> Any:
    if isinstance(meta, dict):
        return {k: _restore_args(v) for k, v in meta.items()}
    return ocp.RestoreArgs(restore_type=np.ndarray)  # host numpy, whatever was saved


def load_orbax(path: str | Path, dtype: np.dtype | None = None
               ) -> tuple[ModelConfig, Params, Tokenizer, dict[str, Any]]:
    """Read a checkpoint written by ``save_orbax``: (config, params, tokenizer, marker).

    ``dtype`` None keeps the stored dtype; otherwise arrays are cast (on the host).
    """
    path = Path(path).expanduser().absolute()
    marker = read_marker(path)
    cfg_path = path / CONFIG_FILE
    try:
        config = ModelConfig.from_dict(json.loads(cfg_path.read_text()))
    except (OSError, json.JSONDecodeError, TypeError, ConfigError) as e:
        raise CheckpointError(f"{cfg_path}: malformed checkpoint config ({e})") from None
    try:
        tokenizer = Tokenizer.from_dir(path)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from e
    params_dir = path / PARAMS_DIR
    if not params_dir.is_dir():
        raise CheckpointError(f"{params_dir}: parameter directory is missing")
    try:
        with ocp.PyTreeCheckpointer() as ckptr:
            meta = ckptr.metadata(params_dir).item_metadata
            if meta is None:
                raise CheckpointError(f"{params_dir}: orbax metadata is missing or corrupt")
            params = ckptr.restore(params_dir, args=ocp.args.PyTreeRestore(
                restore_args=_restore_args(meta.tree)))
    except CheckpointError:
        raise
    except Exception as e:  # orbax/tensorstore raise many types for missing/corrupt data
        raise CheckpointError(f"{params_dir}: cannot restore orbax parameters "
                              f"({type(e).__name__}: {e})") from None
    if dtype is not None:
        params = cast_params(params, dtype)
    validate_params(config, params, str(path))
    return config, params, tokenizer, marker
