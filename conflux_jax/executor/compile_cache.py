"""JAX's persistent compilation cache, on by default so restarts skip XLA compiles."""

from __future__ import annotations

import os
from pathlib import Path

import jax

ENV_VAR = "CONFLUX_COMPILE_CACHE"  # a directory, or "off"
_enabled: str | None = None


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "conflux_jax" / "xla"


def enable_compilation_cache(path: str | Path | None = None) -> str | None:
    """Point JAX at a persistent cache (idempotent). Returns the directory, or None if off."""
    global _enabled
    target = str(path) if path is not None else os.environ.get(ENV_VAR) or str(
        default_cache_dir())
    if target.lower() == "off":
        return None
    if _enabled == target:
        return target
    Path(target).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", target)
    # Cache every executable: on CPU most compile in well under the 1 s default.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _enabled = target
    return target


def calibration_dir(cache_dir: str | Path | None) -> Path:
    """Where latency fits calibrated on this machine are kept: inside the compile cache
    (they describe the same executables), or inside its default place when it is off."""
    return Path(cache_dir or default_cache_dir()) / "latency-fits"
