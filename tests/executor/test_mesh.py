"""The host-device flags a simulated CPU mesh asks XLA for."""

from __future__ import annotations

import os

import pytest

from conflux_jax.executor.mesh import devices_named_by, simulate_cpu_devices


@pytest.mark.parametrize(("before", "count", "after"), [
    ("", 4, "--xla_force_host_platform_device_count=4 --xla_cpu_multi_thread_eigen=false"),
    ("", 1, "--xla_force_host_platform_device_count=1"),
    ("--xla_dump_to=/tmp/d", 2,
     "--xla_dump_to=/tmp/d --xla_force_host_platform_device_count=2 "
     "--xla_cpu_multi_thread_eigen=false"),
    # The user's choice of threads is kept.
    ("--xla_cpu_multi_thread_eigen=true", 4,
     "--xla_cpu_multi_thread_eigen=true --xla_force_host_platform_device_count=4"),
    # A device count already asked for wins over ours, with whatever else was set.
    ("--xla_force_host_platform_device_count=8", 4, "--xla_force_host_platform_device_count=8"),
])
def test_simulated_devices_flags(monkeypatch, before, count, after):
    monkeypatch.setenv("XLA_FLAGS", before)
    simulate_cpu_devices(count)
    assert os.environ["XLA_FLAGS"] == after


@pytest.mark.parametrize(("mesh", "default", "want"), [
    ("sp=4,tp=1", 1, 4), ("sp=2,tp=2", 1, 4), ("sp=2", 1, 2), (None, 3, 3), ("tp=2", 1, 1),
])
def test_devices_named_by(mesh, default, want):
    assert devices_named_by(mesh, default) == want
