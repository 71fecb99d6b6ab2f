"""``load_checkpoint``: one entry point for every checkpoint kind we read.

``spec`` is ``"default"`` (the embedded SmolLM2), a ``.gguf`` file, an HF safetensors
folder (``config.json`` + ``*.safetensors``) or one of our orbax checkpoint directories
(a directory literally named ``default`` needs a path form such as ``./default``).
Every failure is a ``CheckpointError`` whose message names the offending file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from conflux_jax.checkpoints.default_model import ensure_default_checkpoint
from conflux_jax.checkpoints.hf_safetensors import CONFIG_FILE, is_safetensors_dir
from conflux_jax.checkpoints.layout import resolve_dtype
from conflux_jax.checkpoints.orbax_store import is_orbax_checkpoint, load_orbax
from conflux_jax.checkpoints.sources import load_gguf, load_safetensors
from conflux_jax.config import ConfigError, ModelConfig
from conflux_jax.models.params import CheckpointError, Params
from conflux_jax.tokenizer import Tokenizer, TokenizerError

DEFAULT_SPEC = "default"
_GGUF_MAGIC = b"GGUF"


@dataclasses.dataclass(frozen=True, eq=False)
class Checkpoint:
    """A loaded model: config, host parameters (layout of ``models/params.py``, numpy
    arrays in the requested dtype), its tokenizer, and where it came from."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer
    source: str


def load_checkpoint(spec: str | Path, dtype: Any = "float32", *, progress: bool = False,
                    checkpoint_dir: str | Path | None = None) -> Checkpoint:
    """Load ``spec`` (see module doc) with parameters in ``dtype``
    (``"float32"`` | ``"bfloat16"`` | ``"float16"``). ``checkpoint_dir`` is the store the
    default model is converted into and read from (default: see ``resolve_store``)."""
    dt = resolve_dtype(dtype)
    try:
        if isinstance(spec, str) and spec == DEFAULT_SPEC:
            path = ensure_default_checkpoint(checkpoint_dir)
            config, params, tokenizer, _ = load_orbax(path, dt)
            return _finish(config, params, tokenizer, str(path))
        path = Path(spec).expanduser()
        if not path.exists():
            raise CheckpointError(f"{path}: no such file or directory")
        if path.is_file() and path.suffix == ".safetensors" and \
                (path.parent / CONFIG_FILE).is_file():
            path = path.parent  # a weight file inside an HF folder: load the folder
        if path.is_file():
            if path.suffix.lower() == ".gguf" or _has_gguf_magic(path):
                config, params, tokenizer = load_gguf(path, dt, progress=progress)
                return _finish(config, params, tokenizer, str(path))
            raise CheckpointError(
                f"{path}: not a checkpoint; expected a .gguf file, an HF safetensors folder "
                "or a conflux_jax orbax checkpoint directory")
        if is_orbax_checkpoint(path):
            config, params, tokenizer, _ = load_orbax(path, dt)
            return _finish(config, params, tokenizer, str(path))
        if is_safetensors_dir(path):
            config, params, tokenizer = load_safetensors(path, dt, progress=progress)
            return _finish(config, params, tokenizer, str(path))
        raise CheckpointError(_explain_unknown_dir(path))
    except (ConfigError, TokenizerError) as e:  # callers catch one type
        raise CheckpointError(str(e)) from e
    except OSError as e:  # unreadable file, permission denied, ...
        raise CheckpointError(f"{e.filename or spec}: {e.strerror or e}") from e


def _finish(config: ModelConfig, params: Params, tokenizer: Tokenizer,
            source: str) -> Checkpoint:
    """Check the tokenizer fits the model and agree on special ids."""
    if tokenizer.vocab_size > config.vocab_size:
        raise CheckpointError(f"{source}: tokenizer has {tokenizer.vocab_size} tokens but the "
                              f"model's vocab_size is {config.vocab_size}")
    eos = tuple(dict.fromkeys([*config.eos_token_ids, *tokenizer.eos_token_ids]))
    bos = config.bos_token_id if config.bos_token_id is not None else tokenizer.bos_token_id
    config = config.replace(eos_token_ids=eos, bos_token_id=bos)
    tokenizer.eos_token_ids = eos
    if tokenizer.bos_token_id is None:
        tokenizer.bos_token_id = bos
    return Checkpoint(config=config, params=params, tokenizer=tokenizer, source=source)


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _explain_unknown_dir(path: Path) -> str:
    has_config = (path / CONFIG_FILE).is_file()
    has_weights = any(path.glob("*.safetensors"))
    if has_config and not has_weights:
        return f"{path}: has config.json but no *.safetensors weight files"
    if has_weights and not has_config:
        return f"{path}: has *.safetensors weights but no config.json"
    return (f"{path}: not a checkpoint directory; expected an HF safetensors folder "
            "(config.json + *.safetensors) or a conflux_jax orbax checkpoint")
