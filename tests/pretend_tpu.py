"""Lowering for a TPU from this CPU host (test helper): JAX's backend check says TPU, and
the TPU kernel's lookups of the chip (Mosaic's tiling, the tuned block-size table) see the
default device's kind as a TPU v5e's."""

from __future__ import annotations

import pytest

from pallas_kernels import _common


def pretend_tpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import tuned_block_sizes

    monkeypatch.setattr(_common, "on_tpu", lambda: True)
    monkeypatch.setattr(tpu_info, "get_device_kind", lambda: "TPU v5 lite")
    monkeypatch.setattr(tpu_info, "get_num_device_cores", lambda: 1)
    monkeypatch.setattr(tuned_block_sizes, "get_tpu_version", lambda: 5)
    monkeypatch.setattr(tuned_block_sizes, "get_device_name",
                        lambda num_devices=None: "TPU v5" + (f"-{num_devices}" if num_devices
                                                            else ""))
