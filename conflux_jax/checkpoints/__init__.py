"""Checkpoint loading and conversion.

``load_checkpoint(spec, dtype)`` reads the embedded default model (``"default"``), a GGUF
file, an HF safetensors folder or our orbax checkpoint directory into a ``Checkpoint``
(config, numpy params in the ``models/params.py`` layout, tokenizer). ``convert`` /
``python -m conflux_jax.checkpoints convert SRC DST`` writes the orbax format.
"""

from conflux_jax.checkpoints.convert import convert, main
from conflux_jax.checkpoints.default_model import (
    DEFAULT_MODEL_NAME,
    default_gguf_path,
    default_store_dir,
    ensure_default_checkpoint,
)
from conflux_jax.checkpoints.layout import SUPPORTED_DTYPES, resolve_dtype
from conflux_jax.checkpoints.loader import Checkpoint, load_checkpoint
from conflux_jax.checkpoints.orbax_store import is_orbax_checkpoint, load_orbax, save_orbax
from conflux_jax.models.params import CheckpointError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "SUPPORTED_DTYPES",
    "Checkpoint",
    "CheckpointError",
    "convert",
    "default_gguf_path",
    "default_store_dir",
    "ensure_default_checkpoint",
    "is_orbax_checkpoint",
    "load_checkpoint",
    "load_orbax",
    "main",
    "resolve_dtype",
    "save_orbax",
]
