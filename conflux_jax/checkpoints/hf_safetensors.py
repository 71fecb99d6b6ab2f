"""HuggingFace checkpoint folders: ``config.json`` + ``*.safetensors`` (single or sharded).

Supports ``LlamaForCausalLM`` (Llama 3.x, SmolLM2) and ``Qwen3ForCausalLM``. HF stores
linear weights ``[out, in]`` per layer; we transpose to ``[in, out]`` and stack layers.
bf16 tensors are read through numpy with ``ml_dtypes`` registered (plain numpy has no
bfloat16), so nothing touches an accelerator while loading.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  -- registers "bfloat16" with numpy for safetensors' numpy backend
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from conflux_jax.checkpoints.layout import NameTable, ParamAssembler, Placement
from conflux_jax.config import ConfigError, ModelConfig
from conflux_jax.models.params import CheckpointError, Params

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

_TOP: dict[str, Placement] = {
    "model.embed_tokens.weight": Placement("embed"),
    "model.norm.weight": Placement("final_norm"),
    "lm_head.weight": Placement("lm_head", transpose=True),
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")
_PER_LAYER: dict[str, tuple[str, bool]] = {  # HF sub-name -> (our key, transpose)
    "input_layernorm": ("attn_norm", False),
    "self_attn.q_proj": ("wq", True),
    "self_attn.k_proj": ("wk", True),
    "self_attn.v_proj": ("wv", True),
    "self_attn.o_proj": ("wo", True),
    "self_attn.q_norm": ("q_norm", False),
    "self_attn.k_norm": ("k_norm", False),
    "post_attention_layernorm": ("mlp_norm", False),
    "mlp.gate_proj": ("w_gate", True),
    "mlp.up_proj": ("w_up", True),
    "mlp.down_proj": ("w_down", True),
}
_NAMES = NameTable(_TOP, _LAYER_RE, _PER_LAYER)
_FLOAT_DTYPES = {"F32", "F16", "BF16", "F64"}


def is_safetensors_dir(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file() and any(path.glob("*.safetensors"))


def hf_placement(name: str, config: ModelConfig) -> Placement | None | bool:
    """Our place for HF tensor ``name``; ``None`` if unknown, ``False`` if to be ignored."""
    if name.endswith("rotary_emb.inv_freq"):  # old exports save the RoPE table; we recompute
        return False
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return False  # tied: some exports still write the (identical) head; ours has none
    return _NAMES.place(name)


def safetensors_files(folder: Path) -> list[Path]:
    """The weight files of ``folder``, from the shard index when there is one."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed shard index ({e!r})") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard {f.name}, which is missing")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    return files


def load_hf_config(folder: Path) -> ModelConfig:
    """``config.json`` -> ModelConfig, adding stop ids from ``generation_config.json``."""
    try:
        config = ModelConfig.from_hf_json(folder / CONFIG_FILE)
    except ConfigError as e:
        raise CheckpointError(str(e)) from e
    gen = folder / GENERATION_CONFIG_FILE
    if gen.is_file():
        try:
            eos: Any = json.loads(gen.read_text()).get("eos_token_id")
        except (json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError(f"{gen}: not valid JSON ({e})") from None
        extra = eos if isinstance(eos, list) else ([] if eos is None else [eos])
        merged = tuple(dict.fromkeys([*config.eos_token_ids, *map(int, extra)]))
        config = config.replace(eos_token_ids=merged)
    return config


def load_safetensors_params(folder: Path, config: ModelConfig, dtype: np.dtype,
                            progress: bool = False) -> Params:
    """Read every weight of the checkpoint in ``folder`` into our layout (arrays in ``dtype``)."""
    files = safetensors_files(folder)
    asm = ParamAssembler(config, dtype, source=str(folder / CONFIG_FILE))
    with contextlib.ExitStack() as stack:
        handles: dict[Path, Any] = {}
        plan: list[tuple[Path, str, Placement]] = []
        for f in files:
            try:
                handles[f] = h = stack.enter_context(safe_open(str(f), framework="numpy"))
                names = list(h.keys())
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: truncated or corrupt safetensors file ({e})"
                                      ) from None
            for name in names:
                p = hf_placement(name, config)
                if p is False:
                    continue
                sl = h.get_slice(name)
                if sl.get_dtype() not in _FLOAT_DTYPES:
                    asm.problem(f"tensor {name} in {f.name} has unsupported dtype "
                                f"{sl.get_dtype()}")
                    continue
                asm.check(f"{name} in {f.name}", p, tuple(sl.get_shape()))
                if p is not None:
                    plan.append((f, name, p))
        asm.check_complete([p for _, _, p in plan])
        asm.raise_if_problems()
        for f, name, p in tqdm(plan, desc="loading safetensors", unit="tensor",
                               disable=not progress, leave=False):
            try:
                arr = handles[f].get_tensor(name)
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{f}: cannot read tensor {name} ({e})") from None
            asm.put(p, arr)
    return asm.finish()
