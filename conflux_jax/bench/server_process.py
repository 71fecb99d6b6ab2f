"""A server as a subprocess for the benchmarks: ``python -m serving ARGS`` (ours), or
another engine's OpenAI server module under its own interpreter (a peer), on a free local
port, handed back once ``/health`` answers 200 (warm-up done)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from typing import IO, Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One ``PYTHON -m MODULE --port P ARGS`` process (default: ours, under this
    interpreter); ``stop()`` (or leaving the ``with``) ends it."""

    def __init__(self, args: list[str], ready_timeout_s: float = 900.0,
                 log: IO[str] | None = None, env: dict[str, str] | None = None,
                 module: str = "serving", python: str = sys.executable) -> None:
        import httpx

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(  # env None: this process's environment
            [python, "-m", module, "--port", str(self.port), *args], stdout=log,
            stderr=subprocess.STDOUT if log is not None else None, env=env)
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before ready")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready after {ready_timeout_s:.0f} s")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
