"""Serving test helpers: the tiny engine, an in-process live server, the CLI server."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

from conflux_jax.bench.server_process import free_port

TINY_BUCKETS = dict(tokens=(16, 64), decode=(8,), decode_pages=(32,), max_prefill_seqs=4)
MAX_MODEL_LEN = 256
MAX_LOGPROBS = 5
# A compact tool-aware chat template (tool names only, earlier calls as Hermes blocks): the
# Hermes system prompt would overflow the tiny model's 256-token context.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t.function.name }} "
    "{% endfor %}<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_tiny_engine(checkpoint: Path, **engine_kwargs: Any) -> Any:
    from conflux_jax.checkpoints import load_checkpoint
    from conflux_jax.engine import Engine, EngineConfig
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig

    ckpt = load_checkpoint(str(checkpoint))
    ec = ExecutorConfig(page_size=8, num_pages=64, max_model_len=MAX_MODEL_LEN,
                        buckets=BucketConfig(**TINY_BUCKETS), num_top_logprobs=MAX_LOGPROBS)
    return Engine(ckpt.config, ckpt.params, ckpt.tokenizer,
                  EngineConfig(executor=ec, **engine_kwargs))


def serving_tiny_engine(checkpoint: Path) -> Any:
    """A tiny engine compiled up front and guarded as a server's is (no compile later)."""
    engine = build_tiny_engine(checkpoint)
    engine.executor.warmup(progress=False)
    engine.executor.guard.serving = True
    return engine


_SHARED_LOOPS: dict[int, list] = {}  # id(engine) -> [its EngineLoop, servers using it]


class LiveServer:
    """A real uvicorn server on 127.0.0.1 in a background thread, plus its engine loop."""

    def __init__(self, engine: Any, **settings: Any) -> None:
        import uvicorn

        from serving.app import create_app
        from serving.engine_loop import EngineLoop
        from serving.http_protocol import uvicorn_config
        from serving.settings import ServerSettings

        self.engine = engine
        # Servers on one engine share its loop: one thread steps an engine.
        shared = _SHARED_LOOPS.get(id(engine))
        if shared is None:
            shared = _SHARED_LOOPS[id(engine)] = [EngineLoop(engine), 0]
            shared[0].start(warmup=False)
        shared[1] += 1
        self.loop = shared[0]
        self.settings = ServerSettings(**{"model_name": "tiny",
                                          "max_model_len": engine.max_model_len,
                                          "max_logprobs": MAX_LOGPROBS,
                                          "stop_loop_on_shutdown": False, **settings})
        self.app = create_app(self.loop, self.settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)

    @property
    def state(self) -> Any:
        return self.app.state.server

    def client(self, **kwargs: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=kwargs.pop("api_key", "none"),
                             max_retries=0, timeout=kwargs.pop("timeout", 60), **kwargs)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine holds no request and the HTTP side has none in flight."""
        deadline = time.monotonic() + timeout
        while self.engine.has_unfinished or self.state.inflight:
            if time.monotonic() > deadline:
                raise AssertionError(f"not idle after {timeout}s: engine holds "
                                     f"{self.engine.num_unfinished}, http {self.state.inflight}")
            time.sleep(0.02)

    def leaked_pages(self) -> int:
        """KV pages still held, counted on the engine thread between two steps: the
        scheduler is not thread-safe, and an abort that ends the last request frees its
        pages there only once the step then in flight has been committed, after the
        request has left ``has_unfinished`` (a count from this thread raced that)."""
        def held(engine: Any) -> int:  # noqa: ANN401
            bm = engine.scheduler.blocks
            return sum(bm.used_pages(r) for r in range(bm.num_ranks))

        return self.loop.call(held).result(timeout=30)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        shared = _SHARED_LOOPS[id(self.engine)]
        shared[1] -= 1
        if shared[1] == 0:
            del _SHARED_LOOPS[id(self.engine)]
            self.loop.stop(drain=False, timeout=30)


# ------------------------------------------------------------------------------ the CLI
REPO = Path(__file__).resolve().parents[2]
TINY_CLI_ARGS = ["--token-buckets", "16,64", "--decode-buckets", "8",
                 "--decode-page-buckets", "32", "--max-prefill-seqs", "4", "--page-size", "8",
                 "--num-pages", "64", "--max-model-len", str(MAX_MODEL_LEN)]


class CliServer:
    """``python -m serving ...`` as a subprocess (what ``make serve`` runs), its output in
    ``log_path``."""

    def __init__(self, args: list[str], log_path: Path, ready_timeout: float) -> None:
        from conflux_jax.bench.server_process import ServerProcess

        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        # As from a user's shell: without the test session's simulated-device flag.
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        try:
            self._server = ServerProcess(args, ready_timeout, log=self._log, env=env)
        except RuntimeError as e:
            self._log.close()
            raise RuntimeError(f"{e}:\n{self.log_path.read_text(errors='replace')}") from e
        self.proc, self.port, self.url = self._server.proc, self._server.port, self._server.url

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        code = self._server.stop(timeout)
        self._log.close()
        return code
