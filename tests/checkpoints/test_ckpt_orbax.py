"""Orbax checkpoints: bit-exact round trips and the ``convert`` CLI."""

from __future__ import annotations

import json

import gguf
import ml_dtypes
import numpy as np
import pytest
from ckpt_helpers import (
    random_hf_weights,
    tiny_llama,
    tiny_qwen3,
    train_tiny_tokenizer,
    write_gguf,
    write_hf_folder,
)

from conflux_jax.checkpoints import (
    CheckpointError,
    is_orbax_checkpoint,
    load_checkpoint,
    load_orbax,
    main,
    save_orbax,
)
from conflux_jax.checkpoints.layout import iter_leaves
from conflux_jax.models.params import param_shapes
from conflux_jax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny_tok():
    return train_tiny_tokenizer()


def _random_params(config, dtype, seed=0):
    rng = np.random.default_rng(seed)

    def make(shapes):
        return {k: make(v) if isinstance(v, dict) else
                rng.standard_normal(v).astype(np.float32).astype(dtype)
                for k, v in shapes.items()}

    return make(param_shapes(config))


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("make", [tiny_llama, tiny_qwen3], ids=["llama", "qwen3"])
def test_round_trip_is_bit_exact(tmp_path, tiny_tok, make, dtype):
    config = make()
    params = _random_params(config, dtype)
    tok = Tokenizer(tiny_tok, bos_token_id=1, eos_token_ids=[2, 0],
                    chat_template="{{ messages[0]['content'] }}")
    dst = save_orbax(tmp_path / "ck", config, params, tok, source="unit-test")
    assert is_orbax_checkpoint(dst)
    assert not [p for p in tmp_path.iterdir() if p.name != "ck"]  # no temp dir left

    got_config, got, got_tok, marker = load_orbax(dst)
    assert got_config == config
    assert marker["source"] == "unit-test" and marker["dtype"] == np.dtype(dtype).name
    want_leaves, got_leaves = iter_leaves(params), iter_leaves(got)
    assert [k for k, _ in got_leaves] == [k for k, _ in want_leaves]
    for (name, w), (_, g) in zip(want_leaves, got_leaves, strict=True):
        assert isinstance(g, np.ndarray) and g.dtype == w.dtype, name
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=name)
    assert got_tok.eos_token_ids == (2, 0) and got_tok.bos_token_id == 1
    assert got_tok.chat_template == "{{ messages[0]['content'] }}"
    assert got_tok.encode("round trip") == tiny_tok.encode("round trip").ids

    # Through the public entry point, with a dtype cast on the way.
    ckpt = load_checkpoint(dst, dtype="float32")
    np.testing.assert_array_equal(ckpt.params["embed"], params["embed"].astype(np.float32))


def test_save_refuses_to_overwrite(tmp_path, tiny_tok):
    config = tiny_llama()
    tok = Tokenizer(tiny_tok, eos_token_ids=[2])
    params = _random_params(config, np.float32)
    (tmp_path / "empty").mkdir()
    save_orbax(tmp_path / "empty", config, params, tok)  # an empty dir is fine
    with pytest.raises(CheckpointError, match="already exists"):
        save_orbax(tmp_path / "empty", config, params, tok)
    params2 = _random_params(config, np.float32, seed=1)
    save_orbax(tmp_path / "empty", config, params2, tok, overwrite=True)
    np.testing.assert_array_equal(load_orbax(tmp_path / "empty")[1]["embed"], params2["embed"])


def test_save_rejects_params_not_matching_config(tmp_path, tiny_tok):
    params = _random_params(tiny_llama(), np.float32)
    with pytest.raises(CheckpointError, match="do not match the config"):
        save_orbax(tmp_path / "x", tiny_qwen3(), params, Tokenizer(tiny_tok))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cli_converts_gguf_and_safetensors(tmp_path, tiny_tok, dtype, capsys):
    config = tiny_llama(tied=False)
    hf = random_hf_weights(config, seed=5)
    sources = {
        "gguf": write_gguf(tmp_path / "m.gguf", config, hf, tiny_tok,
                           gguf.GGMLQuantizationType.Q8_0),
        "safetensors": write_hf_folder(tmp_path / "hf", config, hf, tiny_tok, shards=2),
    }
    for name, src in sources.items():
        dst = tmp_path / f"orbax-{name}"
        assert main(["convert", str(src), str(dst), "--dtype", dtype]) == 0
        out = capsys.readouterr()
        assert str(dst) in out.out and "writing orbax checkpoint" in out.err
        want, got = load_checkpoint(src, dtype=dtype), load_checkpoint(dst, dtype=dtype)
        assert got.config == want.config
        for (k, w), (_, g) in zip(iter_leaves(want.params), iter_leaves(got.params),
                                  strict=True):
            assert g.dtype == np.dtype(dtype), k
            np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"{name}: {k}")
        assert got.tokenizer.encode("converted text") == want.tokenizer.encode("converted text")
        assert json.loads((dst / "conflux_checkpoint.json").read_text())["source"] == str(src)


def test_cli_reports_errors_without_traceback(tmp_path, capsys):
    assert main(["convert", str(tmp_path / "nope.gguf"), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "nope.gguf" in last and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_corrupt_orbax_params_are_reported(tmp_path, tiny_tok):
    config = tiny_llama()
    dst = save_orbax(tmp_path / "ck", config, _random_params(config, np.float32),
                     Tokenizer(tiny_tok))
    # orbax's tree metadata: without it nothing says what arrays the store holds. (Garbage
    # in the tensorstore files is reported too, but orbax then leaves failed reads behind
    # that warn on a later test.)
    (dst / "params" / "_METADATA").write_text("{not json")
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(dst)
    assert str(dst / "params") in str(e.value)
