"""linears="auto" on the CPU: both routes timed on this host's real step shapes, the faster
kept (OpenBLAS only when clearly faster), remembered per host and model, read back."""

from __future__ import annotations

import json
import logging

import jax
import numpy as np
import pytest
from tiny_models import SMALL_STEP, TINY_LLAMA

from conflux_jax.executor import linears_choice
from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
from conflux_jax.models.decoder import random_params

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="OpenBLAS is CPU-only")

PARAMS = random_params(TINY_LLAMA, seed=1, scale=0.2)
ONE_DEVICE = {**SMALL_STEP, "mesh": "sp=1,tp=1"}  # several CPU devices are not measured


def test_pick_keeps_xla_unless_openblas_is_clearly_faster() -> None:
    assert linears_choice.pick({"xla": 1.0, "blas": 0.5}) == "blas"
    assert linears_choice.pick({"xla": 1.0, "blas": 0.97}) == "xla"  # within the margin
    assert linears_choice.pick({"xla": 0.4, "blas": 1.0}) == "xla"


def test_tiny_models_and_device_meshes_take_xla_unmeasured(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(linears_choice, "kernel_cache_dir", lambda: tmp_path)
    ex = JaxExecutor(TINY_LLAMA, PARAMS, ExecutorConfig(**ONE_DEVICE))
    assert ex.linears == ex.step_config.linears == "xla"
    monkeypatch.setattr(linears_choice, "MIN_MEASURED_WEIGHT_BYTES", 0)  # big enough now
    ex = JaxExecutor(TINY_LLAMA, PARAMS, ExecutorConfig(**SMALL_STEP))  # sp=2: 2 devices
    assert ex.linears == "xla"
    assert not (tmp_path / linears_choice.CHOICE_FILE).exists()


def test_auto_measures_once_then_remembers(tmp_path, monkeypatch, caplog) -> None:
    monkeypatch.setattr(linears_choice, "kernel_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(linears_choice, "MIN_MEASURED_WEIGHT_BYTES", 0)  # measure tiny too
    with caplog.at_level(logging.INFO, logger="conflux_jax.executor.jax_executor"):
        ex = JaxExecutor(TINY_LLAMA, PARAMS, ExecutorConfig(**ONE_DEVICE))
    (record,) = json.loads((tmp_path / linears_choice.CHOICE_FILE).read_text()).values()
    assert set(record["seconds"]) == {"xla", "blas"} and min(record["seconds"].values()) > 0
    assert ex.linears == ex.step_config.linears == record["linears"] \
        == linears_choice.pick(record["seconds"])
    assert record["host"] == linears_choice.host_fingerprint()
    assert f"linears: {ex.linears}" in caplog.text
    # the timing runs left the pools as a new executor has them: empty
    assert not np.asarray(ex.k_pool).any() and not np.asarray(ex.v_pool).any()

    def no_timing(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(JaxExecutor, "_time_linears", no_timing)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="conflux_jax.executor.jax_executor"):
        again = JaxExecutor(TINY_LLAMA, PARAMS, ExecutorConfig(**ONE_DEVICE))
    assert again.linears == ex.linears and "measured earlier" in caplog.text


def test_unreadable_record_is_measured_again(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(linears_choice, "kernel_cache_dir", lambda: tmp_path)
    (tmp_path / linears_choice.CHOICE_FILE).write_text("{not json")
    assert linears_choice.recall("any") is None
    choice = linears_choice.LinearsChoice("blas", {"xla": 2.0, "blas": 1.0}, cached=False)
    linears_choice.remember("k", choice, "host")  # replaces the unreadable file
    assert linears_choice.recall("k") == linears_choice.LinearsChoice(
        "blas", {"xla": 2.0, "blas": 1.0}, cached=True)
