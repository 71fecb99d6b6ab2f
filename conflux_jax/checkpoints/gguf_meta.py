"""Open GGUF files and turn their metadata into a ``ModelConfig``.

Key names come from ``gguf.Keys`` (llama.cpp's spelling, ``{arch}.block_count`` etc).
Supported ``general.architecture`` values: ``llama`` (Llama 3.x, SmolLM2) and ``qwen3``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFReader, Keys

from conflux_jax.checkpoints.gguf_rope import recover_llama3_scaling
from conflux_jax.config import ConfigError, ModelConfig, RopeScaling
from conflux_jax.models.params import CheckpointError

GGUF_ARCHITECTURES = {"llama": "llama", "qwen3": "qwen3"}  # GGUF name -> ours
ROPE_FREQS_TENSOR = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
OUTPUT_TENSOR = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.OUTPUT] + ".weight"

_MISSING = object()


def open_gguf(path: Path) -> GGUFReader:
    """A memory-mapped reader; any parse failure becomes one ``CheckpointError``."""
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, struct/IndexError, OSError, ...
        raise CheckpointError(f"{path}: not a valid GGUF file ({type(e).__name__}: {e})"
                              ) from None


def gguf_value(reader: GGUFReader, key: str, default: Any = _MISSING, *,
               source: str = "") -> Any:
    """The metadata value under ``key`` (lists for arrays); ``default`` if absent."""
    field = reader.get_field(key)
    if field is None:
        if default is _MISSING:
            raise CheckpointError(f"{source}: GGUF metadata is missing {key!r}")
        return default
    try:
        return field.contents()
    except Exception as e:
        raise CheckpointError(f"{source}: GGUF metadata {key!r} is unreadable ({e})") from None


def _f32(x: float) -> float:
    """GGUF floats are float32: 1e-5 is stored as 9.99999974e-06. Take the shortest decimal
    that round-trips in float32, which is what the model's config said."""
    return float(str(np.float32(x)))


def _single(value: Any, key: str, source: str) -> int:
    """Per-layer arrays (``head_count`` may be one) must be uniform for our decoder."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"{source}: {key} varies per layer ({value}); unsupported")
        value = value[0]
    return int(value)


def gguf_config(reader: GGUFReader, source: str) -> ModelConfig:
    """ModelConfig from GGUF metadata (+ the ``rope_freqs`` tensor for Llama 3.1+ scaling)."""
    arch = gguf_value(reader, Keys.General.ARCHITECTURE, source=source)
    if arch not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{source}: unsupported architecture {arch!r} "
                              f"(supported: {sorted(GGUF_ARCHITECTURES)})")

    def get(key_template: str, default: Any = _MISSING) -> Any:
        return gguf_value(reader, key_template.format(arch=arch), default, source=source)

    hidden = int(get(Keys.LLM.EMBEDDING_LENGTH))
    n_heads = _single(get(Keys.Attention.HEAD_COUNT), "head_count", source)
    n_kv = _single(get(Keys.Attention.HEAD_COUNT_KV, n_heads), "head_count_kv", source)
    head_dim = int(get(Keys.Attention.KEY_LENGTH, 0)) or hidden // n_heads
    value_dim = int(get(Keys.Attention.VALUE_LENGTH, head_dim))
    rope_dim = int(get(Keys.Rope.DIMENSION_COUNT, head_dim))
    if value_dim != head_dim or rope_dim != head_dim:
        raise CheckpointError(
            f"{source}: key/value/rope dims {head_dim}/{value_dim}/{rope_dim} differ; "
            "unsupported")
    theta = _f32(get(Keys.Rope.FREQ_BASE, 10000.0))

    tokens = gguf_value(reader, Keys.Tokenizer.LIST, None, source=source)
    vocab = len(tokens) if tokens is not None else int(get(Keys.LLM.VOCAB_SIZE))
    tensor_names = {t.name for t in reader.tensors}

    eos = [gguf_value(reader, k, None, source=source)
           for k in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID, Keys.Tokenizer.EOM_ID)]
    bos = gguf_value(reader, Keys.Tokenizer.BOS_ID, None, source=source)
    try:
        return ModelConfig(
            architecture=GGUF_ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_single(get(Keys.LLM.FEED_FORWARD_LENGTH), "ffn", source),
            num_layers=int(get(Keys.LLM.BLOCK_COUNT)),
            num_heads=n_heads,
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rope_theta=theta,
            rope_scaling=_rope_scaling(reader, arch, theta, head_dim, source),
            rms_norm_eps=_f32(get(Keys.Attention.LAYERNORM_RMS_EPS, 1e-5)),
            max_position_embeddings=int(get(Keys.LLM.CONTEXT_LENGTH, 8192)),
            tie_word_embeddings=OUTPUT_TENSOR not in tensor_names,
            qk_norm=arch == "qwen3",
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        )
    except ConfigError as e:
        raise CheckpointError(f"{source}: {e}") from e


def _rope_scaling(reader: GGUFReader, arch: str, theta: float, head_dim: int,
                  source: str) -> RopeScaling | None:
    scaling_type = gguf_value(reader, Keys.Rope.SCALING_TYPE.format(arch=arch), "none",
                              source=source)
    if scaling_type not in ("none", "", None):
        raise CheckpointError(f"{source}: unsupported rope scaling type {scaling_type!r} "
                              "(supported: llama3 via rope_freqs)")
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS_TENSOR), None)
    if freqs is None:
        return None
    orig = gguf_value(reader, Keys.Rope.SCALING_ORIG_CTX_LEN.format(arch=arch), 8192,
                      source=source)
    try:
        factors = gguf.quants.dequantize(freqs.data, freqs.tensor_type)
        return recover_llama3_scaling(factors, theta, head_dim, int(orig))
    except (ValueError, NotImplementedError) as e:
        raise CheckpointError(f"{source}: tensor {ROPE_FREQS_TENSOR}: {e}") from None
