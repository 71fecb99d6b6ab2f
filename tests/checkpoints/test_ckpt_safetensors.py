"""HF safetensors folders: single file, sharded, tied/untied, Llama (llama3 RoPE) and Qwen3."""

from __future__ import annotations

import json

import numpy as np
import pytest
from ckpt_helpers import (
    expected_params,
    random_hf_weights,
    save_hf_tokenizer,
    tiny_llama,
    tiny_qwen3,
    train_tiny_tokenizer,
    write_hf_folder,
)

from conflux_jax.checkpoints import load_checkpoint


@pytest.fixture(scope="module")
def tiny_tok():
    return train_tiny_tokenizer()


def _assert_tree_equal(got: dict, want: dict, prefix: str = "") -> None:
    assert set(got) == set(want), prefix
    for k in want:
        if isinstance(want[k], dict):
            _assert_tree_equal(got[k], want[k], f"{prefix}{k}.")
        else:
            assert got[k].dtype == want[k].dtype, f"{prefix}{k}"
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{prefix}{k}")


# ------------------------------------------------------------ written with numpy only
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("make", [lambda: tiny_llama(tied=False), lambda: tiny_llama(tied=True),
                                  tiny_qwen3], ids=["llama", "llama-tied", "qwen3"])
def test_numpy_written_folder(tmp_path, tiny_tok, make, shards):
    config = make()
    hf = random_hf_weights(config, seed=3)
    folder = write_hf_folder(tmp_path / "m", config, hf, tiny_tok, shards=shards)
    ckpt = load_checkpoint(folder)
    assert ckpt.config == config
    _assert_tree_equal(ckpt.params, expected_params(hf, config))
    assert ckpt.source == str(folder)
    assert ckpt.tokenizer.encode("hello world") == tiny_tok.encode("hello world").ids


def test_tied_checkpoint_with_lm_head_ignores_it(tmp_path, tiny_tok):
    config = tiny_llama(tied=True)
    hf = random_hf_weights(config)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"].copy()
    ckpt = load_checkpoint(write_hf_folder(tmp_path / "m", config, hf, tiny_tok))
    assert "lm_head" not in ckpt.params


def test_generation_config_eos_ids_are_merged(tmp_path, tiny_tok):
    config = tiny_llama()
    folder = write_hf_folder(tmp_path / "m", config, random_hf_weights(config), tiny_tok)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    ckpt = load_checkpoint(folder)
    assert ckpt.config.eos_token_ids == (2, 0) == ckpt.tokenizer.eos_token_ids


def test_weight_file_path_loads_its_folder(tmp_path, tiny_tok):
    config = tiny_llama()
    folder = write_hf_folder(tmp_path / "m", config, random_hf_weights(config), tiny_tok)
    assert load_checkpoint(folder / "model.safetensors").config == config


# ------------------------------------------------------------ written by transformers
def _hf_model(kind: str, tied: bool):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            **common, head_dim=16,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64})
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(**common, head_dim=32,
                                       rope_parameters={"rope_type": "default",
                                                        "rope_theta": 1e6})
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # norms init to 1; make them distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.reference
@pytest.mark.parametrize("shard", [None, "40KB"], ids=["single", "sharded"])
@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen3", False)])
def test_transformers_saved_models(tmp_path, tiny_tok, kind, tied, shard):
    model = _hf_model(kind, tied)
    folder = tmp_path / "hf"
    if shard:
        model.save_pretrained(folder, max_shard_size=shard)
        assert (folder / "model.safetensors.index.json").is_file()
    else:
        model.save_pretrained(folder)
    save_hf_tokenizer(folder, tiny_tok)
    ckpt = load_checkpoint(folder)
    c = ckpt.config
    assert (c.architecture, c.tie_word_embeddings, c.qk_norm) == (kind, tied, kind == "qwen3")
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads) == (64, 2, 4, 2)
    if kind == "llama":
        assert c.head_dim == 16 and c.rope_theta == 500000.0
        rs = c.rope_scaling
        assert (rs.factor, rs.low_freq_factor, rs.high_freq_factor,
                rs.original_max_position_embeddings) == (8.0, 1.0, 4.0, 64)
    else:
        assert c.head_dim == 32 and c.rope_theta == 1e6 and c.rope_scaling is None
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    if tied:
        sd.pop("lm_head.weight", None)
    _assert_tree_equal(ckpt.params, expected_params(sd, c))


@pytest.mark.reference
def test_bf16_checkpoint_is_read_bit_exactly(tmp_path, tiny_tok):
    torch = pytest.importorskip("torch")
    model = _hf_model("qwen3", tied=False).to(torch.bfloat16)
    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    save_hf_tokenizer(folder, tiny_tok)
    sd16 = {k: v.detach().view(torch.int16).numpy() for k, v in model.state_dict().items()}
    sd32 = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}

    bf = load_checkpoint(folder, dtype="bfloat16")
    assert bf.params["layers"]["wq"].dtype.name == "bfloat16"
    want_bits = expected_params(sd16, bf.config)
    got_bits = {"layers": {k: v.view(np.int16) for k, v in bf.params["layers"].items()}}
    _assert_tree_equal(got_bits["layers"], want_bits["layers"])

    f32 = load_checkpoint(folder, dtype="float32")  # upcast is exact
    _assert_tree_equal(f32.params, expected_params(sd32, f32.config))
