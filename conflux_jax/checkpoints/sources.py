"""Read one source format into (config, params, tokenizer), before any reconciliation."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from conflux_jax.checkpoints.gguf_meta import gguf_config, open_gguf
from conflux_jax.checkpoints.gguf_tokenizer import gguf_tokenizer
from conflux_jax.checkpoints.gguf_weights import load_gguf_params
from conflux_jax.checkpoints.hf_safetensors import load_hf_config, load_safetensors_params
from conflux_jax.config import ModelConfig
from conflux_jax.models.params import Params
from conflux_jax.tokenizer import Tokenizer


def load_gguf(path: Path, dtype: np.dtype, *, progress: bool = False
              ) -> tuple[ModelConfig, Params, Tokenizer]:
    """A GGUF file: config from metadata, tokenizer from its vocabulary, dequantized
    weights in ``dtype``."""
    source = str(path)
    reader = open_gguf(path)
    config = gguf_config(reader, source)
    tokenizer = gguf_tokenizer(reader, source)
    params = load_gguf_params(reader, config, dtype, source, progress=progress)
    return config, params, tokenizer


def load_safetensors(folder: Path, dtype: np.dtype, *, progress: bool = False
                     ) -> tuple[ModelConfig, Params, Tokenizer]:
    """An HF folder: config.json (+ generation_config.json), tokenizer files, weights."""
    config = load_hf_config(folder)
    tokenizer = Tokenizer.from_dir(folder, extra_eos_token_ids=config.eos_token_ids)
    params = load_safetensors_params(folder, config, dtype, progress=progress)
    return config, params, tokenizer
