"""Shared test set-up: a simulated 4-device CPU mesh and small model configs."""

import os

# Must precede the first jax import anywhere in the test session.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def smollm2_gguf_checkpoint():
    """The real SmolLM2 GGUF loaded directly (not the converted default store), once per
    session: several modules compare against it and each load dequantizes the whole file.
    Read-only: tests must not change its params."""
    from conflux_jax.checkpoints import CheckpointError, default_gguf_path, load_checkpoint

    try:
        path = default_gguf_path()
    except CheckpointError as e:
        pytest.skip(str(e))
    return load_checkpoint(path)
