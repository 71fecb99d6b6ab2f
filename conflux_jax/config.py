"""Model configuration: one frozen dataclass for every supported decoder family.

Llama 3.x, SmolLM2 (Llama architecture) and Qwen3 differ only in a few switches
(per-head q/k RMSNorm, tied embeddings, RoPE scaling), so one config and one decoder
cover them. Configs come from an HF ``config.json`` or from GGUF metadata.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
}


class ConfigError(ValueError):
    """A checkpoint's configuration is missing, malformed or unsupported."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3 style frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer.

    ``num_heads``/``num_kv_heads`` are the checkpoint's head counts. Head padding for
    meshes whose size does not divide them is done by the executor at load time.
    """

    architecture: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k before RoPE
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise ConfigError(f"unsupported architecture {self.architecture!r}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf_dict(cls, hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Build from a HuggingFace ``config.json`` dictionary."""
        archs = hf.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES),
                    None)
        if arch is None:
            model_type = hf.get("model_type")
            arch = {"llama": "llama", "qwen3": "qwen3"}.get(model_type or "")
        if arch is None:
            raise ConfigError(
                f"{source}: unsupported architecture {archs or hf.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            head_dim = int(hf.get("head_dim") or hidden // num_heads)
            # transformers >= 5 writes `rope_parameters` (theta included); older files
            # have `rope_theta` plus an optional `rope_scaling`.
            rope = dict(hf.get("rope_parameters") or {})
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            return cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
                rope_scaling=_rope_scaling_from_hf(rope or hf.get("rope_scaling"), source),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qk_norm=arch == "qwen3",
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except KeyError as e:
            raise ConfigError(f"{source}: missing required field {e.args[0]!r}") from None

    @classmethod
    def from_hf_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(hf, source=str(path))


def _rope_scaling_from_hf(rs: dict[str, Any] | None, source: str) -> RopeScaling | None:
    if not rs:
        return None
    rope_type = rs.get("rope_type") or rs.get("type")
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise ConfigError(f"{source}: unsupported rope_scaling type {rope_type!r} "
                          "(supported: 'llama3')")
    try:
        return RopeScaling(
            factor=float(rs["factor"]),
            low_freq_factor=float(rs["low_freq_factor"]),
            high_freq_factor=float(rs["high_freq_factor"]),
            original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
        )
    except KeyError as e:
        raise ConfigError(f"{source}: rope_scaling is missing {e.args[0]!r}") from None
