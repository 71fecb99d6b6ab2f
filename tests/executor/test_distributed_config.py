"""Where a process learns its place in a multi-process instance: flags, our environment
variables, Kubernetes LeaderWorkerSet's, Slurm's; a partial setting is refused."""

from __future__ import annotations

import pytest

from conflux_jax.executor.distributed import (
    DEFAULT_PORT,
    DistributedConfig,
    local_device_count,
    resolve,
)


@pytest.mark.parametrize(("flags", "env", "want"), [
    ({}, {}, None),
    ({"coordinator": "10.0.0.1:1234", "num_processes": 2, "process_id": 1}, {},
     DistributedConfig(2, 1, "10.0.0.1:1234")),
    # Flags win over the environment.
    ({"coordinator": "a:1", "num_processes": 4, "process_id": 3},
     {"CONFLUX_COORDINATOR": "b:2", "CONFLUX_NUM_PROCESSES": "2", "CONFLUX_PROCESS_ID": "0"},
     DistributedConfig(4, 3, "a:1")),
    ({}, {"CONFLUX_COORDINATOR": "b:2", "CONFLUX_NUM_PROCESSES": "2",
          "CONFLUX_PROCESS_ID": "0", "LWS_LEADER_ADDRESS": "ignored"},
     DistributedConfig(2, 0, "b:2")),
    ({}, {"LWS_LEADER_ADDRESS": "grp-0.grp.ns", "LWS_GROUP_SIZE": "4",
          "LWS_WORKER_INDEX": "2"}, DistributedConfig(4, 2, f"grp-0.grp.ns:{DEFAULT_PORT}")),
    ({}, {"LWS_LEADER_ADDRESS": "grp-0", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "0",
          "CONFLUX_COORDINATOR_PORT": "9000"}, DistributedConfig(2, 0, "grp-0:9000")),
    # Slurm: JAX's own Slurm support finds the coordinator from the step's nodes.
    ({}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SLURM_PROCID": "1"},
     DistributedConfig(2, 1, None)),
    ({}, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),
    # A group of one is a single process.
    ({}, {"LWS_LEADER_ADDRESS": "x", "LWS_GROUP_SIZE": "1", "LWS_WORKER_INDEX": "0"}, None),
])
def test_resolve(flags, env, want):
    assert resolve(**flags, environ=env) == want


@pytest.mark.parametrize(("flags", "env", "error"), [
    ({"num_processes": 2}, {}, "needs the process count and this process's id"),
    ({"num_processes": 2, "process_id": 0}, {}, "no coordinator"),
    ({}, {"CONFLUX_NUM_PROCESSES": "two", "CONFLUX_PROCESS_ID": "0"}, "not an integer"),
    ({"coordinator": "nohost", "num_processes": 2, "process_id": 0}, {}, "not HOST:PORT"),
    ({"coordinator": "a:1", "num_processes": 2, "process_id": 2}, {}, r"not in \[0, 2\)"),
])
def test_partial_or_bad_settings_are_refused(flags, env, error):
    with pytest.raises(ValueError, match=error):
        resolve(**flags, environ=env)


def test_local_device_count():
    assert local_device_count(4, 2) == 2
    with pytest.raises(ValueError, match="does not split"):
        local_device_count(3, 2)
