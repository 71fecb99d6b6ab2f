"""``ExecutorConfig.linears="auto"`` on the CPU: XLA's dot or OpenBLAS, whichever runs this
host's steps faster, measured once per host, model and library versions, and remembered.

Two hosts of one kind disagree by 2x either way (bench/RESULTS.md): on an AVX2-only EPYC
OpenBLAS halved the 16-request decode step; on an AVX-512 one it made a 128-token prefill
step 2-2.5x slower than XLA's own dot. So the route is measured on the real step
(``JaxExecutor._time_linears``), not assumed. The record lives beside the built handler
(``$CONFLUX_KERNEL_CACHE``), keyed by everything the timing depends on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
from pathlib import Path

from pallas_kernels.cpu_gemm import kernel_cache_dir, library_key

log = logging.getLogger(__name__)

CHOICE_FILE = "linears-choice.json"
# Below this many weight bytes neither route matters next to a step's fixed costs: XLA's
# dot, unmeasured (tiny test models stay deterministic and start at once). Meshes of
# several CPU devices take it unmeasured too (JaxExecutor._choose_linears).
MIN_MEASURED_WEIGHT_BYTES = 32 << 20
# OpenBLAS must beat XLA's dot by this much: within noise, the route without an FFI call.
BLAS_MARGIN = 0.95


@dataclasses.dataclass(frozen=True)
class LinearsChoice:
    linears: str  # "xla" | "blas"
    seconds: dict[str, float]  # route -> the measured steps' summed medians
    cached: bool  # read back from an earlier measurement


def host_fingerprint() -> str:
    """The CPU model, its flags and how many cores this process may use."""
    model, flags = platform.processor(), ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value.strip()
    except OSError:
        pass
    return f"{model}|{hashlib.sha256(flags.encode()).hexdigest()[:12]}|" \
           f"{len(os.sched_getaffinity(0))} cpus"


def choice_key(model_key: str, shapes: list[str]) -> str:
    """One entry per host, model, measured step shapes and library build."""
    return hashlib.sha256("\n".join([host_fingerprint(), model_key, *shapes,
                                     library_key()]).encode()).hexdigest()[:20]


def pick(seconds: dict[str, float]) -> str:
    return "blas" if seconds["blas"] < BLAS_MARGIN * seconds["xla"] else "xla"


def _path() -> Path:
    return kernel_cache_dir() / CHOICE_FILE


def recall(key: str) -> LinearsChoice | None:
    try:
        entry = json.loads(_path().read_text())[key]
        return LinearsChoice(entry["linears"], entry["seconds"], cached=True)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # none yet, or unreadable: measure again


def remember(key: str, choice: LinearsChoice, host: str) -> None:
    path = _path()
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        records = {}
    records[key] = {"linears": choice.linears, "seconds": choice.seconds, "host": host}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(records, indent=1))
    os.replace(tmp, path)  # whole or not at all: concurrent starts may race
