"""Builders for small checkpoints in every format we read (no torch needed here).

HF-named float32 weights are the ground truth; writers turn them into an HF safetensors
folder or a GGUF file the way HF / llama.cpp would, and ``expected_params`` gives the
layout our loader must produce from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import tokenizers
from safetensors.numpy import save_file
from tokenizers import decoders, models, pre_tokenizers, trainers

from conflux_jax.config import ModelConfig, RopeScaling

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n\nprint(add(2, 40))\n",
    "Checkpoints, tokenizers and conversion: 0123456789 and 3.14159.",
    "Unicode: café naïve 日本語 한국어 🦙 — done.",
]
TINY_VOCAB = 320  # model vocab; the trained tokenizer has <= 300 tokens


def tiny_llama(tied: bool = False, rope_scaling: bool = True) -> ModelConfig:
    return ModelConfig(
        architecture="llama", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=64) if rope_scaling else None,
        rms_norm_eps=1e-5, max_position_embeddings=512, tie_word_embeddings=tied,
        bos_token_id=1, eos_token_ids=(2,))


def tiny_qwen3(tied: bool = False) -> ModelConfig:
    # head_dim != hidden / heads, as in real Qwen3 models.
    return ModelConfig(
        architecture="qwen3", vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rope_theta=1e6,
        rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=tied,
        qk_norm=True, bos_token_id=1, eos_token_ids=(2,))


def train_tiny_tokenizer(vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A byte-level BPE trained on CORPUS; ids 0..2 are SPECIALS."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def save_hf_tokenizer(folder: Path, backend: tokenizers.Tokenizer,
                      chat_template: str | None = None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    cfg: dict[str, Any] = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                           "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def random_hf_weights(config: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """HF-named float32 weights for ``config`` ([out, in] matrices)."""
    rng = np.random.default_rng(seed)
    c = config
    D, F, d = c.hidden_size, c.intermediate_size, c.head_dim

    def mat(out: int, inp: int) -> np.ndarray:
        return (rng.standard_normal((out, inp)) * 0.05).astype(np.float32)

    def vec(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(c.vocab_size, D), "model.norm.weight": vec(D)}
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = mat(c.vocab_size, D)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = vec(D)
        w[p + "self_attn.q_proj.weight"] = mat(c.num_heads * d, D)
        w[p + "self_attn.k_proj.weight"] = mat(c.num_kv_heads * d, D)
        w[p + "self_attn.v_proj.weight"] = mat(c.num_kv_heads * d, D)
        w[p + "self_attn.o_proj.weight"] = mat(D, c.num_heads * d)
        if c.qk_norm:
            w[p + "self_attn.q_norm.weight"] = vec(d)
            w[p + "self_attn.k_norm.weight"] = vec(d)
        w[p + "post_attention_layernorm.weight"] = vec(D)
        w[p + "mlp.gate_proj.weight"] = mat(F, D)
        w[p + "mlp.up_proj.weight"] = mat(F, D)
        w[p + "mlp.down_proj.weight"] = mat(D, F)
    return w


_OURS = {"input_layernorm": ("attn_norm", False), "self_attn.q_proj": ("wq", True),
         "self_attn.k_proj": ("wk", True), "self_attn.v_proj": ("wv", True),
         "self_attn.o_proj": ("wo", True), "self_attn.q_norm": ("q_norm", False),
         "self_attn.k_norm": ("k_norm", False), "post_attention_layernorm": ("mlp_norm", False),
         "mlp.gate_proj": ("w_gate", True), "mlp.up_proj": ("w_up", True),
         "mlp.down_proj": ("w_down", True)}


def expected_params(hf: dict[str, np.ndarray], config: ModelConfig) -> dict[str, Any]:
    """The layout of models/params.py built straightforwardly from HF-named arrays."""
    out: dict[str, Any] = {"embed": hf["model.embed_tokens.weight"],
                           "final_norm": hf["model.norm.weight"], "layers": {}}
    if not config.tie_word_embeddings:
        out["lm_head"] = hf["lm_head.weight"].T
    for sub, (key, transpose) in _OURS.items():
        per = [hf.get(f"model.layers.{i}.{sub}.weight") for i in range(config.num_layers)]
        if per[0] is not None:
            out["layers"][key] = np.stack([x.T if transpose else x for x in per])
    return out


def hf_config_json(config: ModelConfig) -> dict[str, Any]:
    """A transformers-4 style config.json for ``config``."""
    c = config
    d: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if c.architecture == "llama"
                          else "Qwen3ForCausalLM"],
        "model_type": c.architecture, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_layers,
        "num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads,
        "head_dim": c.head_dim, "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
        "max_position_embeddings": c.max_position_embeddings,
        "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
        "eos_token_id": list(c.eos_token_ids),
    }
    if c.rope_scaling is not None:
        rs = c.rope_scaling
        d["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor,
                             "low_freq_factor": rs.low_freq_factor,
                             "high_freq_factor": rs.high_freq_factor,
                             "original_max_position_embeddings":
                                 rs.original_max_position_embeddings}
    return d


def write_hf_folder(folder: Path, config: ModelConfig, weights: dict[str, np.ndarray],
                    tokenizer: tokenizers.Tokenizer | None = None, shards: int = 1,
                    config_json: dict[str, Any] | None = None) -> Path:
    """An HF checkpoint folder written with safetensors' numpy API (no torch)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_json or hf_config_json(config)))
    if tokenizer is not None:
        save_hf_tokenizer(folder, tokenizer)
    names = sorted(weights)
    if shards == 1:
        save_file({n: weights[n] for n in names}, str(folder / "model.safetensors"))
        return folder
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: weights[n] for n in part}, str(folder / fname))
        weight_map.update({n: fname for n in part})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# ------------------------------------------------------------------------------ GGUF
_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def llamacpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute`` (q/k rows, llama only)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    _, _, i, rest = hf_name.split(".", 3)
    return f"blk.{i}.{_GGUF_NAMES[rest.removesuffix('.weight')]}.weight"


def quantized_roundtrip(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """What a reader gets back for ``w`` stored as ``qtype`` (f32[out, in])."""
    if w.ndim == 1 or not _quantizable(w, qtype):
        return w
    if qtype == gguf.GGMLQuantizationType.F16:
        return w.astype(np.float16).astype(np.float32)
    return gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)


def _quantizable(w: np.ndarray, qtype: gguf.GGMLQuantizationType) -> bool:
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return w.ndim == 2 and w.shape[-1] % block == 0


def write_gguf(path: Path, config: ModelConfig, weights: dict[str, np.ndarray],
               backend: tokenizers.Tokenizer, qtype: gguf.GGMLQuantizationType,
               *, rope_freqs: np.ndarray | None = None, pre: str = "gpt2",
               arch: str | None = None, chat_template: str | None = None,
               tensor_types: dict[str, gguf.GGMLQuantizationType] | None = None,
               raw: dict[str, tuple[np.ndarray, tuple[int, ...] | None, gguf.GGMLQuantizationType]]
               | None = None) -> Path:
    """A GGUF file as llama.cpp's converter writes it: metadata, tokenizer, Q/K permuted
    for llama, 2-D tensors in ``qtype`` (1-D norms stay F32, like llama.cpp)."""
    c = config
    arch = arch or c.architecture
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_heads)
    w.add_head_count_kv(c.num_kv_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if c.head_dim != c.hidden_size // c.num_heads:
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    tokens = [backend.id_to_token(i) for i in range(vocab)]
    tok_json = json.loads(backend.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    specials = {t["content"] for t in tok_json["added_tokens"] if t["special"]}
    # The model vocab may be padded beyond the tokenizer; llama.cpp lists every row.
    tokens += [f"[PAD{i}]" for i in range(vocab, c.vocab_size)]
    types = [gguf.TokenType.CONTROL if t in specials else
             gguf.TokenType.UNUSED if t.startswith("[PAD") else gguf.TokenType.NORMAL
             for t in tokens]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name in sorted(weights):
        arr = weights[name]
        if arch == "llama" and name.endswith("q_proj.weight"):
            arr = llamacpp_permute(arr, c.num_heads, c.num_heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            arr = llamacpp_permute(arr, c.num_heads, c.num_kv_heads)
        gname = gguf_name(name)
        t = (tensor_types or {}).get(gname, qtype)
        if raw and gname in raw:  # pre-encoded bytes, e.g. a type gguf-py cannot write
            data, shape, rtype = raw[gname]
            w.add_tensor(gname, data, raw_shape=shape, raw_dtype=rtype)
        elif arr.ndim == 1 or not _quantizable(arr, t) or t == gguf.GGMLQuantizationType.F32:
            w.add_tensor(gname, arr.astype(np.float32))
        elif t == gguf.GGMLQuantizationType.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(arr, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
