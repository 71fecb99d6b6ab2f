"""What a server is configured with (``ServerSettings``) and what its routes and request
flows share while it runs (``ServerState``). A leaf both sides import, so neither imports
the other."""

from __future__ import annotations

import dataclasses
from typing import Any

from serving.engine_loop import EngineLoop
from serving.formatting import TokenText
from serving.metrics import Metrics


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_queue: int = 256  # requests admitted and not finished; more get 429
    max_body_bytes: int = 1 << 20
    max_logprobs: int = 0  # top alternatives the executor computes (its num_top_logprobs)
    retry_after_s: int = 1
    stop_loop_on_shutdown: bool = True  # the app owns the loop (CLI); tests share one
    tool_call_parser: str | None = None  # None: by the model's chat template
    chat_template: str | None = None  # replaces the model's own (vLLM's --chat-template)


@dataclasses.dataclass
class ServerState:
    loop: EngineLoop
    settings: ServerSettings
    metrics: Metrics
    tokenizer: Any
    token_text: TokenText
    inflight: int = 0  # requests admitted on the HTTP side and not yet ended
