"""The ``("sp", "tp")`` device mesh of one XP instance.

``sp`` = N logical ranks (Ulysses degree for prefill, one decode home each);
``tp`` = the base tensor-parallel group inside a logical rank (Appendix C).
"""

from __future__ import annotations

import dataclasses
import os
import re

import jax
import numpy as np
from jax.sharding import Mesh

SP, TP = "sp", "tp"


@dataclasses.dataclass(frozen=True)
class MeshSpec:
    sp: int
    tp: int = 1

    @property
    def size(self) -> int:
        return self.sp * self.tp

    @classmethod
    def parse(cls, text: str | None, num_devices: int | None = None) -> MeshSpec:
        """``"sp=4,tp=1"`` (either key optional); ``None`` = every device as an sp rank."""
        n = num_devices if num_devices is not None else jax.device_count()
        if not text:
            return cls(sp=n, tp=1)
        fields: dict[str, int] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            if not sep or key not in (SP, TP) or not value.strip().isdigit():
                raise ValueError(f"bad mesh {text!r}: expected e.g. 'sp=4,tp=1'")
            fields[key] = int(value)
        tp = fields.get(TP, 1)
        sp = fields.get(SP, max(1, n // tp))
        if sp < 1 or tp < 1:
            raise ValueError(f"bad mesh {text!r}: sizes must be positive")
        if sp * tp > n:
            raise ValueError(f"mesh {text!r} needs {sp * tp} devices but only {n} are visible"
                             " (on CPU set XLA_FLAGS=--xla_force_host_platform_device_count=N"
                             " before importing jax)")
        return cls(sp=sp, tp=tp)


def make_mesh(spec: MeshSpec) -> Mesh:
    devices = np.asarray(jax.devices()[: spec.size]).reshape(spec.sp, spec.tp)
    return Mesh(devices, (SP, TP))


def devices_named_by(mesh: str | None, default: int) -> int:
    """Devices an ``"sp=4,tp=1"``-style mesh needs, or ``default`` when it names no sp size
    (a malformed mesh is reported by ``MeshSpec.parse`` later, with its own message)."""
    sizes = dict(re.findall(r"(sp|tp)\s*=\s*(\d+)", mesh or ""))
    if "sp" not in sizes:
        return default
    return max(1, int(sizes["sp"]) * int(sizes.get("tp", 1)))


def simulate_cpu_devices(count: int = 4) -> None:
    """Ask XLA for ``count`` host devices; only effective before jax initialises.

    Several simulated devices also get one compute thread each: they already time-share
    the host's cores, and a thread pool per device would put several threads on each core.
    Steps run as fast either way (``bench/timing_noise.py``), and the shipped ``sp=4``
    latency fit was timed like this, so the server runs like this too. XLA_FLAGS that
    already name a device count are left as they are.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags:
        return
    new = [f"--xla_force_host_platform_device_count={count}"]
    if count > 1 and "xla_cpu_multi_thread_eigen" not in flags:
        new.append("--xla_cpu_multi_thread_eigen=false")
    os.environ["XLA_FLAGS"] = " ".join([flags, *new]).strip()
