"""GGUF tensors -> our parameter layout (dequantized with ``gguf.quants``).

``GGUFReader`` reports shapes in ggml order (innermost first); reversed they are numpy
order, ``[out, in]`` for matrices, which ``gguf.quants.dequantize`` returns.

Q/K row order: llama.cpp's HF converter permutes the rows of ``q_proj``/``k_proj`` for
the **llama** architecture (``LlamaModel.permute``), because ggml's llama graph applies
RoPE to interleaved pairs (x0,x1),(x2,x3)... while HF rotates halves (x_i, x_{i+d/2}).
Our decoder uses the HF convention, so we undo that permutation per head. The **qwen3**
converter does not permute (its graph uses NEOX-style half rotation, like HF), and
neither does transformers' GGUF loader for it, so Qwen3 tensors are used as stored.
"""

from __future__ import annotations

import functools
import re

import gguf
import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from tqdm import tqdm

from conflux_jax.checkpoints.gguf_meta import ROPE_FREQS_TENSOR
from conflux_jax.checkpoints.layout import NameTable, ParamAssembler, Placement
from conflux_jax.config import ModelConfig
from conflux_jax.models.params import CheckpointError, Params

_T = gguf.MODEL_TENSOR
_TOP: dict[str, Placement] = {
    gguf.TENSOR_NAMES[_T.TOKEN_EMBD] + ".weight": Placement("embed"),
    gguf.TENSOR_NAMES[_T.OUTPUT_NORM] + ".weight": Placement("final_norm"),
    gguf.TENSOR_NAMES[_T.OUTPUT] + ".weight": Placement("lm_head", transpose=True),
}
_PER_LAYER: dict[str, tuple[str, bool]] = {  # "attn_q" -> (our key, transpose)
    gguf.TENSOR_NAMES[t].removeprefix("blk.{bid}."): v
    for t, v in {
        _T.ATTN_NORM: ("attn_norm", False),
        _T.ATTN_Q: ("wq", True),
        _T.ATTN_K: ("wk", True),
        _T.ATTN_V: ("wv", True),
        _T.ATTN_OUT: ("wo", True),
        _T.ATTN_Q_NORM: ("q_norm", False),
        _T.ATTN_K_NORM: ("k_norm", False),
        _T.FFN_NORM: ("mlp_norm", False),
        _T.FFN_GATE: ("w_gate", True),
        _T.FFN_UP: ("w_up", True),
        _T.FFN_DOWN: ("w_down", True),
    }.items()
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)\.weight")
_NAMES = NameTable(_TOP, _LAYER_RE, _PER_LAYER)


def gguf_placement(name: str) -> Placement | None | bool:
    """Our place for GGUF tensor ``name``; ``None`` if unknown, ``False`` if consumed
    elsewhere (``rope_freqs`` goes into the config)."""
    if name == ROPE_FREQS_TENSOR:
        return False
    return _NAMES.place(name)


@functools.cache
def can_dequantize(qtype: GGMLQuantizationType) -> bool:
    """Whether ``gguf.quants`` can dequantize ``qtype`` (probed on one zero block)."""
    if qtype not in gguf.GGML_QUANT_SIZES:
        return False
    _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    try:
        gguf.quants.dequantize(np.zeros((1, nbytes), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: f32[n_heads*d, D] -> f32[n_heads*d, D].

    Within each head llama.cpp stores rows as [r0, r_{d/2}, r1, r_{d/2+1}, ...]
    (interleaved pairs); HF wants the halves [r0..r_{d/2-1}, r_{d/2}..r_{d-1}].
    """
    d = w.shape[0] // n_heads
    return w.reshape(n_heads, d // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf_params(reader: GGUFReader, config: ModelConfig, dtype: np.dtype, source: str,
                     progress: bool = False) -> Params:
    """Dequantize every weight into our layout (arrays in ``dtype``)."""
    asm = ParamAssembler(config, dtype, source)
    plan: list[tuple[gguf.ReaderTensor, Placement]] = []
    for t in reader.tensors:
        p = gguf_placement(t.name)
        if p is False:
            continue
        if not can_dequantize(t.tensor_type):
            asm.problem(f"tensor {t.name} uses unsupported type {t.tensor_type.name}")
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        asm.check(t.name, p, shape)
        if p is not None:
            plan.append((t, p))
    asm.check_complete([p for _, p in plan])
    asm.raise_if_problems()

    permuted = config.architecture == "llama"
    for t, p in tqdm(plan, desc="dequantizing GGUF", unit="tensor", disable=not progress,
                     leave=False):
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # truncated data, bad block layout
            raise CheckpointError(f"{source}: cannot dequantize tensor {t.name} "
                                  f"({t.tensor_type.name}): {e}") from None
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))
        if permuted and p.key == "wq":
            w = unpermute_qk(w, config.num_heads)
        elif permuted and p.key == "wk":
            w = unpermute_qk(w, config.num_kv_heads)
        asm.put(p, w)
    return asm.finish()
