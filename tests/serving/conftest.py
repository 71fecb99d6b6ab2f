"""Serving test fixtures: one tiny warmed engine per session, one live server per module.

The engine (tiny random Llama + trained byte-level BPE tokenizer, small buckets) is built
and warmed once; each test module starts its own uvicorn server on a free loopback port,
in a thread of this process, with a fresh ``EngineLoop`` that takes over the shared engine.
Being in-process lets tests look at the engine's block manager (leaked pages) and inject
faults at the executor boundary without mocking our logic.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "checkpoints"))

from ckpt_helpers import (  # noqa: E402
    random_hf_weights,
    tiny_llama,
    train_tiny_tokenizer,
    write_hf_folder,
)
from serving_helpers import LiveServer, serving_tiny_engine  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_llama()
    folder = tmp_path_factory.mktemp("serving") / "tiny"
    return write_hf_folder(folder, cfg, random_hf_weights(cfg), train_tiny_tokenizer())


@pytest.fixture(scope="session")
def tiny_engine(tiny_checkpoint: Path) -> Any:
    return serving_tiny_engine(tiny_checkpoint)


@pytest.fixture(scope="module")
def make_server(tiny_engine: Any) -> Iterator[Any]:
    """Factory: start one server per module on the shared engine (stopped at module end)."""
    servers: list[LiveServer] = []

    def make(**settings: Any) -> LiveServer:
        s = LiveServer(tiny_engine, **settings)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.stop()
    assert not tiny_engine.has_unfinished, "a test module left requests in the engine"
