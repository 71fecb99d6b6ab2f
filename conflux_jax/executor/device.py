"""Facts of the accelerator the executor runs on: its platform, the compute dtype that
suits it, the token buckets that suit it, and how much memory one device has.

The engine's defaults follow the device rather than the CPU it was developed on: bf16
weights, KV and activations on a GPU or TPU (with fp32 accumulation in the dots, fp32
norms and softmax), fp32 on a CPU, where bf16 dots are emulated and gain nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import jax

from conflux_jax.executor.buckets import BucketConfig

log = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
ACCELERATORS = ("gpu", "cuda", "rocm", "tpu")
# vLLM's default share of device memory the engine may use (--gpu-memory-utilization).
DEFAULT_MEMORY_UTILIZATION = 0.9

# On an accelerator padded rows are nearly free below the GEMMs' knee (a few hundred
# tokens: weight-read bound) and each bucket is one more executable to compile, so the
# buckets are coarse and reach further: long prompts go in fewer, larger chunks, and a
# rank hosts hundreds of decodes. Decode page tables are as wide as the step's longest
# context needs, in steps of 8x (capped at the max model length's width): at a long max
# length a table of full width is built, sent and read every step (256 decodes at 128K
# tokens, 16-token pages: 8 MiB), though most contexts are short.
ACCELERATOR_BUCKETS = BucketConfig(tokens=(16, 64, 256, 512, 1024, 2048),
                                   decode=(16, 64, 256), decode_pages=(128, 1024, 8192),
                                   max_prefill_seqs=16)


def is_accelerator(platform: str) -> bool:
    return platform.lower() in ACCELERATORS


def resolve_dtype(dtype: str, platform: str) -> str:
    """The compute dtype for ``dtype`` ("auto" or an explicit name) on ``platform``."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; use one of {DTYPES}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if is_accelerator(platform) else "float32"


def default_platform() -> str:
    """The platform of the devices the executor would use (jax's default backend)."""
    return jax.devices()[0].platform


def default_buckets(platform: str) -> BucketConfig:
    """The bucket sets for ``platform``: small first buckets on a CPU, where padded rows
    cost real FLOPs; larger ones on an accelerator."""
    return ACCELERATOR_BUCKETS if is_accelerator(platform) else BucketConfig()


def host_memory_bytes() -> int:
    """Physical memory of this host (what simulated CPU devices share)."""
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def memory_budget(devices: Sequence[jax.Device], utilization: float,
                  hbm_bytes: float | None = None) -> tuple[int, int]:
    """(device size, the bytes the engine may use on one device): ``utilization`` of the
    device's memory, as vLLM's ``--gpu-memory-utilization`` means it.

    The size is the device's physical memory ``hbm_bytes`` (from the hardware table) when
    known, else what its runtime reports. The budget never exceeds the runtime's allocator
    limit (``memory_stats()["bytes_limit"]``: on a GPU, XLA_PYTHON_CLIENT_MEM_FRACTION of
    the card, 0.75 unless set; the server sets it to the utilization). A CPU reports
    nothing reliable: its simulated devices share the host's memory, an equal share each.
    """
    if not 0 < utilization <= 1:
        raise ValueError(f"memory utilization must be in (0, 1], got {utilization}")
    dev = devices[0]
    if dev.platform == "cpu":
        size = host_memory_bytes() // len(devices)
        return size, int(utilization * size)
    stats = dev.memory_stats() or {}
    limit = int(stats.get("bytes_limit") or 0)
    size = int(hbm_bytes) if hbm_bytes else limit
    if not size:
        raise RuntimeError(f"{dev.device_kind} reports no memory size: pass num_pages")
    budget = int(utilization * size)
    if limit and budget > limit:
        log.warning("utilization %.2f of %.1f GiB exceeds the allocator's %.1f GiB limit "
                    "(XLA_PYTHON_CLIENT_MEM_FRACTION); using the limit", utilization,
                    size / 2**30, limit / 2**30)
        budget = limit
    return size, budget
