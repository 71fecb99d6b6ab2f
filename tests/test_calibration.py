"""The self-calibrating scheduler, forced on CPU: a setup with no shipped fit starts from
the device estimate, warm-up profiles random batches on the real executor and fits, the
held-out error goes to the log, and the fit is saved so that a restart loads it."""

from __future__ import annotations

import dataclasses
import logging
import math
from pathlib import Path

import jax
import pytest
import tokenizers
from tiny_models import SMALL_STEP, TINY_LLAMA

from conflux_jax.engine import Engine, EngineConfig, default_latency_model
from conflux_jax.engine.calibration import Budget, CalibrationKey, load_saved, saved_path
from conflux_jax.executor.jax_executor import ExecutorConfig
from conflux_jax.latency import LatencyModel
from conflux_jax.models.decoder import random_params
from conflux_jax.tokenizer import Tokenizer

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

PARAMS = random_params(TINY_LLAMA, seed=1, scale=0.2)
# Three step shapes, a pool sized from a forced 8 MiB "device": the executables of
# tests/executor/test_kv_sizing.py, which the compile cache then shares.
EXEC = ExecutorConfig(**SMALL_STEP, gpu_memory_utilization=0.5, device_memory_bytes=8 << 20)


def _tokenizer() -> Tokenizer:
    vocab = {f"w{i}": i for i in range(TINY_LLAMA.vocab_size)}
    return Tokenizer(tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0")),
                     eos_token_ids=(2,))


def _engine(tmp: Path, **kw) -> Engine:
    cfg = EngineConfig(executor=EXEC, calibrate=True,
                       calibration_budget=Budget(num_train=16, num_test=8, repeats=1),
                       calibration_dir=str(tmp), **kw)
    return Engine(TINY_LLAMA, PARAMS, _tokenizer(), cfg)


def test_calibrates_at_warmup_saves_and_a_restart_loads(tmp_path: Path, caplog) -> None:
    engine = _engine(tmp_path)
    # No shipped fit and no device in the hardware table: the built-in estimate first,
    # priced on the executor's token buckets.
    assert engine.latency_model == default_latency_model(TINY_LLAMA.num_layers, 2
                                                         ).for_buckets((32,))
    with caplog.at_level(logging.INFO, logger="conflux_jax.engine.calibration"):
        engine.warmup(progress=False)
    fitted = engine.scheduler.model
    assert fitted is engine.latency_model and fitted.meta["source"] == "calibration"
    err = fitted.meta["heldout_mape_pct"]
    assert math.isfinite(err) and fitted.meta["num_test"] == 8
    assert f"held-out MAPE {err:.1f}% over 8 batches" in caplog.text
    # The fit prices this executor's buckets and simulated ranks sharing the cores.
    assert fitted.token_buckets == (32,) and fitted.shared_cores
    path = saved_path(engine.executor, engine.model_name, tmp_path)
    assert path.is_file() and LatencyModel.load(path) == fitted

    again = _engine(tmp_path)  # a restart: the saved fit, no calibration pending
    assert again.latency_model == fitted and not again._needs_calibration
    forced = _engine(tmp_path, recalibrate=True)
    assert forced._needs_calibration and forced.latency_model != fitted
    # A fit is only reused for the setup it measured: other buckets, another file; and a
    # file whose key is not this setup's is not loaded.
    key = CalibrationKey.of(engine.executor, engine.model_name)
    assert dataclasses.replace(key, tokens=(8, 32)).path(tmp_path) != path
    assert load_saved(engine.executor, "another-model", tmp_path) is None
    path.write_text(path.read_text().replace('"num_pages": ', '"num_pages": 1'))
    assert load_saved(engine.executor, engine.model_name, tmp_path) is None
