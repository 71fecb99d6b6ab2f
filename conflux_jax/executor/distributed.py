"""One instance over several processes: JAX's multi-controller runtime.

Every process of a multi-host instance calls :func:`initialize` before anything touches a
JAX backend; afterwards ``jax.devices()`` lists every process's devices and the executor's
mesh spans them. Process 0 (the leader) runs the scheduler and the HTTP server; the others
are followers (``multihost.follow``). On CPU the processes talk over JAX's gloo
collectives, so a multi-process instance also runs on one machine.

Where the three numbers come from, first match wins: explicit values (``--coordinator``,
``--num-processes``, ``--process-id``), ``CONFLUX_COORDINATOR`` / ``CONFLUX_NUM_PROCESSES``
/ ``CONFLUX_PROCESS_ID``, Kubernetes LeaderWorkerSet (``LWS_LEADER_ADDRESS``,
``LWS_GROUP_SIZE``, ``LWS_WORKER_INDEX``; the port is ``CONFLUX_COORDINATOR_PORT``), or a
Slurm step of several tasks (``SLURM_NTASKS``, ``SLURM_PROCID``; JAX's own Slurm support
finds the coordinator from the step's node list unless one is given).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Mapping
from typing import NoReturn

log = logging.getLogger(__name__)

DEFAULT_PORT = 8476  # the coordinator port JAX's own cluster detection uses
# JAX's default is 100 s: a dead process would stall the instance that long.
DEFAULT_HEARTBEAT_TIMEOUT_S = 10


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """How this process joins a multi-process instance."""

    num_processes: int
    process_id: int
    # "host:port" of process 0's coordination service; None = JAX's cluster detection
    # finds it (Slurm).
    coordinator: str | None
    # A process silent this long is declared dead, and every other process then fails.
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
    init_timeout_s: int = 300  # how long process 0 waits for the others to join

    def __post_init__(self) -> None:
        if self.num_processes < 1:
            raise ValueError(f"num_processes must be positive, got {self.num_processes}")
        if not 0 <= self.process_id < self.num_processes:
            raise ValueError(f"process id {self.process_id} is not in "
                             f"[0, {self.num_processes})")
        if self.coordinator is not None:
            host, sep, port = self.coordinator.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ValueError(f"coordinator {self.coordinator!r} is not HOST:PORT")
        if self.heartbeat_timeout_s < 1 or self.init_timeout_s < 1:
            raise ValueError("distributed timeouts must be at least 1 s")

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0


def _int(value: str, name: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def resolve(coordinator: str | None = None, num_processes: int | None = None,
            process_id: int | None = None, environ: Mapping[str, str] | None = None,
            heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S,
            ) -> DistributedConfig | None:
    """This process's place in a multi-process instance, or None for a single process.

    Explicit values win, then the environment (see the module docstring). A partial
    setting (a process count but no id, ...) is an error, never silently one process.
    """
    env = os.environ if environ is None else environ
    given = (coordinator, num_processes, process_id)
    source = "--coordinator/--num-processes/--process-id"
    if all(v is None for v in given):
        given, source = _from_env(env)
    coordinator, num_processes, process_id = given
    if all(v is None for v in given):
        return None
    if num_processes is None or process_id is None:
        raise ValueError(f"{source}: a multi-process instance needs the process count and "
                         "this process's id (and process 0's address)")
    if coordinator is None and "SLURM_JOB_ID" not in env:
        raise ValueError(f"{source}: no coordinator address (HOST:PORT of process 0)")
    if num_processes == 1:
        return None
    return DistributedConfig(num_processes, process_id, coordinator,
                             heartbeat_timeout_s=heartbeat_timeout_s)


def _from_env(env: Mapping[str, str]
              ) -> tuple[tuple[str | None, int | None, int | None], str]:
    names = ("CONFLUX_COORDINATOR", "CONFLUX_NUM_PROCESSES", "CONFLUX_PROCESS_ID")
    if any(n in env for n in names):
        coord = env.get(names[0])
        count = _int(env[names[1]], names[1]) if names[1] in env else None
        pid = _int(env[names[2]], names[2]) if names[2] in env else None
        return (coord, count, pid), "/".join(names)
    port = _int(env.get("CONFLUX_COORDINATOR_PORT", str(DEFAULT_PORT)),
                "CONFLUX_COORDINATOR_PORT")
    if "LWS_LEADER_ADDRESS" in env:  # Kubernetes LeaderWorkerSet: one group = one instance
        coord = f"{env['LWS_LEADER_ADDRESS']}:{port}"
        count = _int(env.get("LWS_GROUP_SIZE", ""), "LWS_GROUP_SIZE")
        pid = _int(env.get("LWS_WORKER_INDEX", ""), "LWS_WORKER_INDEX")
        return (coord, count, pid), "LWS_LEADER_ADDRESS/LWS_GROUP_SIZE/LWS_WORKER_INDEX"
    if "SLURM_NTASKS" in env and "SLURM_PROCID" in env:
        count = _int(env["SLURM_NTASKS"], "SLURM_NTASKS")
        if count > 1:
            return (None, count, _int(env["SLURM_PROCID"], "SLURM_PROCID")), \
                "SLURM_NTASKS/SLURM_PROCID"
    return (None, None, None), ""


def initialize(cfg: DistributedConfig) -> None:
    """Join the instance: JAX's coordination service (hosted by process 0) and, on CPU,
    gloo collectives. Call before anything initialises a JAX backend."""
    import jax

    # Without it CPU devices of different processes cannot run collectives; it only
    # affects the CPU client, so it is harmless on a GPU or TPU host.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info("joining a %d-process instance as process %d (coordinator %s)",
             cfg.num_processes, cfg.process_id, cfg.coordinator or "from Slurm")
    jax.distributed.initialize(cfg.coordinator, num_processes=cfg.num_processes,
                               process_id=cfg.process_id,
                               initialization_timeout=cfg.init_timeout_s,
                               heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)


def local_device_count(total: int, num_processes: int) -> int:
    """Devices each process contributes to a ``total``-device mesh (CPU: how many host
    devices to simulate per process)."""
    if total % num_processes:
        raise ValueError(f"a {total}-device mesh does not split over {num_processes} "
                         "processes")
    return total // num_processes


def exit_now(code: int) -> NoReturn:
    """Exit without JAX's shutdown barrier, which would wait for a dead process until
    its heartbeat times out and then abort: after the instance is lost there is nobody to
    meet there."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
