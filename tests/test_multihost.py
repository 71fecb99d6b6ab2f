"""One instance over two processes (2 x 2 CPU devices, JAX's multi-controller runtime).

Oracles: the same engine on this session's single-process four-device mesh, and solo
greedy generation with the dense reference. The instance runs as two real processes
(``multihost_instance.py``) talking over gloo and JAX's coordination service.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import multihost_instance as instance
import pytest

import conflux_jax
from conflux_jax import reference
from conflux_jax.bench.server_process import free_port
from conflux_jax.sampling import SamplingParams

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")

SCRIPT = Path(instance.__file__)
START_S = 120  # start-up and the first compiles on a loaded 2-core machine
# A dead follower must fail the leader this fast: gloo notices the closed connection at
# once (JAX's coordination service would, after its 10 s heartbeat timeout).
FAIL_S = 20


def start_pair(tmp_path: Path, mode: str) -> tuple[subprocess.Popen, subprocess.Popen]:
    port = str(free_port())
    root = str(Path(conflux_jax.__file__).parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [root, *filter(None, [os.environ.get("PYTHONPATH")])]))

    def spawn(pid: int) -> subprocess.Popen:
        with open(tmp_path / f"process{pid}.log", "w") as log:  # the child keeps its copy
            return subprocess.Popen(
                [sys.executable, str(SCRIPT), str(pid), port, str(tmp_path / "tokens.json"),
                 mode], stdout=log, stderr=subprocess.STDOUT, env=env)

    return spawn(0), spawn(1)


def log_of(tmp_path: Path, pid: int) -> str:
    return (tmp_path / f"process{pid}.log").read_text()


def follower_steps(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in log_of(tmp_path, 1).splitlines()
            if line.startswith('{"shape"')]


def stop(*procs: subprocess.Popen) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def solo_greedy(prompt: list[int], n: int) -> list[int]:
    out: list[int] = []
    reference.ReferenceGenerator(instance.TINY_LLAMA, instance.PARAMS).generate(
        [prompt], [SamplingParams(max_tokens=n, temperature=0)],
        lambda row, tok, lp, top: (out.append(tok), len(out) >= n)[1])
    return out


def test_two_processes_match_one_process_and_the_reference_and_fail_when_one_dies(
        tmp_path):
    leader, follower = start_pair(tmp_path, "mixed")
    tokens_file = tmp_path / "tokens.json"
    try:
        deadline = time.monotonic() + START_S
        while not tokens_file.exists():
            assert leader.poll() is None, log_of(tmp_path, 0)
            assert time.monotonic() < deadline, "the instance did not finish the workload"
            time.sleep(0.2)
        steps_before = len(follower_steps(tmp_path))
        while len(follower_steps(tmp_path)) <= steps_before + 2:  # it serves on
            assert time.monotonic() < deadline, log_of(tmp_path, 1)
            time.sleep(0.1)
        follower.kill()
        killed = time.monotonic()
        leader.wait(FAIL_S)  # raises TimeoutExpired if the leader hangs
        failed_after = time.monotonic() - killed
    finally:
        stop(leader, follower)
    out = log_of(tmp_path, 0)
    assert failed_after < FAIL_S
    if leader.returncode == -signal.SIGABRT:
        # Seen once in ~25 runs, under CI load: no error reached the leader's step from
        # the dead peer (it does in ~30 ms otherwise), and JAX's heartbeat timeout, the
        # backstop DistributedConfig sets to 10 s, aborted it: the instance still failed
        # within FAIL_S, not gracefully.
        assert "stopped sending heartbeats" in out, out
    else:
        assert leader.returncode == 3, out
        assert "instance lost" in out and "process most likely died" in out, out

    steps = follower_steps(tmp_path)
    assert any(s["prefills"] and s["decodes"] and s["transfer_groups"] for s in steps), \
        "no step of the workload mixed prefill, decode and a KV transfer"
    got = json.loads(tokens_file.read_text())
    assert got == instance.run_mixed(instance.make_engine())  # one process, four devices
    assert got == [solo_greedy(p, n)
                   for p, n in zip(instance.prompts(), instance.budgets(), strict=True)]


def test_followers_exit_cleanly_when_the_leader_stops(tmp_path):
    leader, follower = start_pair(tmp_path, "idle")
    try:
        assert leader.wait(START_S) == 0, log_of(tmp_path, 0)
        assert follower.wait(FAIL_S) == 0, log_of(tmp_path, 1)
    finally:
        stop(leader, follower)
    assert "refused after the stop: this multi-process instance was stopped" in \
        log_of(tmp_path, 0)
