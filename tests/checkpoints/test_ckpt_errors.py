"""Bad input: each case is one CheckpointError whose one-line message names the file and
the problem."""

from __future__ import annotations

import json

import gguf
import pytest
from ckpt_helpers import (
    hf_config_json,
    random_hf_weights,
    tiny_llama,
    train_tiny_tokenizer,
    write_gguf,
    write_hf_folder,
)

from conflux_jax.checkpoints import CheckpointError, load_checkpoint
from conflux_jax.config import ConfigError


@pytest.fixture(scope="module")
def tiny_tok():
    return train_tiny_tokenizer()


@pytest.fixture
def hf_folder(tmp_path, tiny_tok):
    config = tiny_llama()
    return write_hf_folder(tmp_path / "hf", config, random_hf_weights(config), tiny_tok)


def _error(spec, **kw) -> str:
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(spec, **kw)
    msg = str(e.value)
    assert "\n" not in msg and isinstance(e.value, ValueError)
    return msg


def test_missing_path(tmp_path):
    msg = _error(tmp_path / "nowhere")
    assert str(tmp_path / "nowhere") in msg and "no such file" in msg


def test_truncated_safetensors(hf_folder):
    f = hf_folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    msg = _error(hf_folder)
    assert str(f) in msg and "truncated or corrupt safetensors" in msg


def test_garbage_safetensors(hf_folder):
    f = hf_folder / "model.safetensors"
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    msg = _error(hf_folder)
    assert str(f) in msg and "corrupt safetensors" in msg


def test_missing_shard(tmp_path, tiny_tok):
    config = tiny_llama()
    folder = write_hf_folder(tmp_path / "hf", config, random_hf_weights(config), tiny_tok,
                             shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    msg = _error(folder)
    assert "model.safetensors.index.json" in msg and "model-00002-of-00002" in msg


@pytest.mark.parametrize("payload", [b"garbage, not a gguf file", b"GGUF" + b"\x03\x00" * 40],
                         ids=["no-magic", "truncated-header"])
def test_garbage_gguf(tmp_path, payload):
    f = tmp_path / "bad.gguf"
    f.write_bytes(payload)
    msg = _error(f)
    assert str(f) in msg and "not a valid GGUF file" in msg


def test_truncated_gguf(tmp_path, tiny_tok):
    config = tiny_llama()
    f = write_gguf(tmp_path / "m.gguf", config, random_hf_weights(config), tiny_tok,
                   gguf.GGMLQuantizationType.Q8_0)
    f.write_bytes(f.read_bytes()[:-4096])
    msg = _error(f)
    assert str(f) in msg and "not a valid GGUF file" in msg


def test_malformed_config_json(hf_folder):
    (hf_folder / "config.json").write_text('{"hidden_size": 64,')
    msg = _error(hf_folder)
    assert str(hf_folder / "config.json") in msg and "not valid JSON" in msg


def test_config_json_missing_field(hf_folder):
    cfg = json.loads((hf_folder / "config.json").read_text())
    del cfg["num_attention_heads"]
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    msg = _error(hf_folder)
    assert str(hf_folder / "config.json") in msg and "num_attention_heads" in msg


def test_unsupported_architecture_hf(hf_folder):
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(hf_folder)
    assert isinstance(e.value.__cause__, ConfigError)  # one type to catch, cause kept
    assert "GPT2LMHeadModel" in str(e.value) and "unsupported architecture" in str(e.value)
    assert str(hf_folder / "config.json") in str(e.value)


def test_unsupported_architecture_gguf(tmp_path, tiny_tok):
    config = tiny_llama()
    f = write_gguf(tmp_path / "m.gguf", config, random_hf_weights(config), tiny_tok,
                   gguf.GGMLQuantizationType.F32, arch="gpt2")
    msg = _error(f)
    assert str(f) in msg and "unsupported architecture 'gpt2'" in msg


def test_wrong_hidden_size_in_config(hf_folder):
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg["hidden_size"] = 128
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    msg = _error(hf_folder)
    assert str(hf_folder / "config.json") in msg and "do not match the config" in msg
    assert "model.embed_tokens.weight" in msg and "(320, 64)" in msg and "(320, 128)" in msg


def test_too_few_layers_in_config(tmp_path, tiny_tok):
    config = tiny_llama()
    cfg = hf_config_json(config) | {"num_hidden_layers": 1}
    folder = write_hf_folder(tmp_path / "hf", config, random_hf_weights(config), tiny_tok,
                             config_json=cfg)
    msg = _error(folder)
    assert "unexpected tensor model.layers.1." in msg
    assert "layer 1 is out of range; the config has 1 layers" in msg


def test_missing_weight(tmp_path, tiny_tok):
    config = tiny_llama()
    hf = random_hf_weights(config)
    del hf["model.layers.1.mlp.up_proj.weight"]
    msg = _error(write_hf_folder(tmp_path / "hf", config, hf, tiny_tok))
    assert "missing weight layers.w_up for layer(s) 1" in msg


def test_unknown_tensor(tmp_path, tiny_tok):
    config = tiny_llama()
    hf = random_hf_weights(config)
    hf["model.layers.0.self_attn.q_proj.bias"] = hf["model.norm.weight"]
    msg = _error(write_hf_folder(tmp_path / "hf", config, hf, tiny_tok))
    assert "unexpected tensor model.layers.0.self_attn.q_proj.bias" in msg


def test_missing_tokenizer(tmp_path):
    config = tiny_llama()
    folder = write_hf_folder(tmp_path / "hf", config, random_hf_weights(config))
    msg = _error(folder)
    assert str(folder / "tokenizer.json") in msg and "not found" in msg


def test_tokenizer_larger_than_model_vocab(tmp_path, tiny_tok):
    config = tiny_llama().replace(vocab_size=100)
    folder = write_hf_folder(tmp_path / "hf", config, random_hf_weights(config), tiny_tok)
    msg = _error(folder)
    assert "tokenizer has" in msg and "vocab_size is 100" in msg


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    msg = _error(tmp_path)
    assert str(tmp_path) in msg and "not a checkpoint directory" in msg
    msg = _error(tmp_path / "notes.txt")
    assert "notes.txt: not a checkpoint" in msg


def test_unsupported_dtype(hf_folder):
    assert "unsupported dtype 'int8'" in _error(hf_folder, dtype="int8")
