"""A ``bench compare`` peer behind an OpenAI server process: our own server, or another
engine's, driven by the client that measures ``--url`` so every server is timed alike."""

from __future__ import annotations

import resource
from typing import IO

from conflux_jax.bench.metrics import RequestResult
from conflux_jax.bench.serve import run_server, server_model
from conflux_jax.bench.serve_workload import ServeRequest
from conflux_jax.bench.server_process import ServerProcess


class ServerPeer:
    """``run`` streams every prompt at once to ``server``; ``close`` stops it (and closes
    the file its output went to)."""

    def __init__(self, name: str, server: ServerProcess, log: IO[str] | None = None) -> None:
        self.name = name
        self._server = server
        self._log = log
        self._model = server_model(server.url)
        self.client_cpu_s = 0.0  # of the last run

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[list[RequestResult], float]:
        """Stream ``prompts``; ``client_cpu_s`` is then the CPU time the measuring client
        took (it shares the host's cores with the server it measures)."""
        start = _cpu_s()
        out = run_server(self._server.url, self._model,
                         [ServeRequest(0.0, p, max_tokens) for p in prompts])
        self.client_cpu_s = _cpu_s() - start
        return out

    def close(self) -> None:
        self._server.stop()
        if self._log is not None:
            self._log.close()


def _cpu_s() -> float:
    """CPU seconds this process has used (user + system), every thread."""
    use = resource.getrusage(resource.RUSAGE_SELF)
    return use.ru_utime + use.ru_stime
