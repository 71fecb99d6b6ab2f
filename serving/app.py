"""The FastAPI app: OpenAI routes over one ``EngineLoop``.

Request path: validate (pydantic) -> check model / readiness / queue -> tokenize here
(so usage counts and the engine see the same ids) -> submit to the engine loop -> stream
``StepOutput``s back as SSE chunks or collect them into one response. A request whose
client goes away (stream closed, or a non-streaming client disconnecting) is aborted so
its KV pages are freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conflux_jax.engine import EngineError
from conflux_jax.sampling import SamplingParams
from serving import formatting as fmt
from serving.auth import ApiKeyMiddleware
from serving.engine_loop import EngineLoop, EngineLoopClosed, RequestStream
from serving.errors import APIError, error_body, install_error_handlers
from serving.limits import BodySizeLimitMiddleware
from serving.metrics import Metrics
from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    new_id,
)

log = logging.getLogger(__name__)


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


@dataclasses.dataclass
class ServerState:
    loop: EngineLoop
    settings: ServerSettings
    metrics: Metrics
    tokenizer: Any
    token_text: fmt.TokenText
    inflight: int = 0


def create_app(loop: EngineLoop, settings: ServerSettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if settings.stop_loop_on_shutdown:
            # uvicorn has drained in-flight requests by now; finish what remains.
            await asyncio.to_thread(loop.stop, drain=True, timeout=60)

    app = FastAPI(title="conflux_jax OpenAI-compatible server", lifespan=lifespan)
    tokenizer = loop.engine.tokenizer
    state = ServerState(loop, settings, Metrics(settings.model_name), tokenizer,
                        fmt.TokenText(tokenizer))
    app.state.server = state
    install_error_handlers(app)
    # Added last = runs first: size limit, then auth, then routing.
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=settings.max_body_bytes)

    @app.get("/health")
    async def health() -> Response:
        if not loop.ready.is_set() or not loop.alive:
            return JSONResponse(error_body(503, "warming up" if loop.alive else
                                           "engine is not running"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(loop.stats),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=settings.model_name,
                                         max_model_len=settings.max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        if isinstance(body.prompt, str):
            ids = await _encode(tokenizer, body.prompt, add_special_tokens=True)
        else:
            ids = [int(t) for t in body.prompt]  # type: ignore[union-attr]
        sampling = _sampling(state, body, body.max_tokens, default_max_tokens=16,
                             num_logprobs=body.logprobs)
        gen = await _Generation.start(state, ids, sampling, body)
        if body.stream:
            return _SSEResponse(gen, gen.completion_chunks(body))
        return JSONResponse(await _collect(gen, request, lambda: gen.completion_body(body)))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        try:
            messages = [{"role": m.role, "content": m.text(),
                         **({"name": m.name} if m.name else {})} for m in body.messages]
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt)
        except ValueError as exc:  # TokenizerError is a ValueError
            raise APIError(400, f"could not apply the chat template: {exc}",
                           param="messages") from None
        # The template already places any BOS; encoding must not add another.
        ids = await _encode(tokenizer, text, add_special_tokens=False)
        n_logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling = _sampling(state, body, body.effective_max_tokens, default_max_tokens=None,
                             num_logprobs=n_logprobs)
        gen = await _Generation.start(state, ids, sampling, body)
        if body.stream:
            return _SSEResponse(gen, gen.chat_chunks(body))
        return JSONResponse(await _collect(gen, request, lambda: gen.chat_body(body)))

    return app


# ------------------------------------------------------------------------------- checks
async def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    # A long prompt (up to the body limit) would stall every stream on this event loop.
    if len(text) < 4096:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text,
                                   add_special_tokens=add_special_tokens)


def _check_model(state: ServerState, model: str) -> None:
    if model != state.settings.model_name:
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"`{state.settings.model_name}`.", param="model")


def _sampling(state: ServerState, body: Any, max_tokens: int | None, *,
              default_max_tokens: int | None, num_logprobs: int | None) -> SamplingParams:
    limit = state.settings.max_logprobs
    if num_logprobs and num_logprobs > limit:
        raise APIError(400, f"this server returns at most {limit} top logprobs per token "
                            "(start it with a larger --max-logprobs)", param="logprobs")
    body.max_tokens = max_tokens
    try:
        return body.sampling_params(default_max_tokens=default_max_tokens,
                                    num_logprobs=num_logprobs)
    except ValueError as exc:
        raise APIError(400, str(exc)) from None


class _SSEResponse(StreamingResponse):
    """SSE stream that always ends its request: a client gone before the first chunk never
    runs the chunk generator (so its ``finally`` never runs); this ``finally`` does."""

    def __init__(self, gen: _Generation, chunks: AsyncIterator[bytes]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._gen.abort()  # no-op for a request that finished


async def _collect(gen: _Generation, request: Request, build: Any) -> dict[str, Any]:
    """Run a non-streaming request to the end, aborting it if the client disconnects."""
    task = asyncio.ensure_future(gen.run_to_end())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                task.result()
                break
            if await request.is_disconnected():
                task.cancel()
                gen.abort()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            gen.abort()
    if gen.finish_reason == "error":
        raise APIError(500, "the engine failed while generating this request; it was "
                            "aborted (the server keeps serving)")
    return build()


# ---------------------------------------------------------------------------- one request
class _Generation:
    """One request's life on the HTTP side: bookkeeping, metrics, abort on early exit."""

    def __init__(self, state: ServerState, prompt_ids: list[int], sampling: SamplingParams):
        self.state = state
        self.prompt_ids = prompt_ids
        self.sampling = sampling
        self.arrival_s = time.perf_counter()
        self.created = fmt.now_s()
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.logprobs: list[dict[int, float]] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.stream: RequestStream | None = None
        self._recorded = False

    @classmethod
    async def start(cls, state: ServerState, ids: list[int], sampling: SamplingParams,
                    body: Any) -> _Generation:
        loop, settings = state.loop, state.settings
        if not loop.ready.is_set() or not loop.alive:
            state.metrics.record_rejected(503)
            raise APIError(503, "the server is warming up or shutting down; retry shortly",
                           headers={"Retry-After": str(settings.retry_after_s)})
        if state.inflight >= settings.max_queue:
            state.metrics.record_rejected(429)
            raise APIError(429, f"the server is at capacity ({settings.max_queue} requests "
                                "in flight); retry later",
                           headers={"Retry-After": str(settings.retry_after_s)})
        gen = cls(state, ids, sampling)
        slo: dict[str, float] = {}
        if body.ttft_slo_ms is not None:
            slo["ttft_slo_s"] = body.ttft_slo_ms / 1000.0
        if body.tbt_slo_ms is not None:
            slo["tbt_slo_s"] = body.tbt_slo_ms / 1000.0
        state.inflight += 1
        try:
            gen.stream = loop.submit(ids, sampling, **slo)
            await gen.stream.accepted
        except (EngineError, ValueError) as exc:
            state.inflight -= 1
            state.metrics.record_rejected(400)
            raise APIError(400, str(exc), param="prompt") from None
        except EngineLoopClosed as exc:
            state.inflight -= 1
            state.metrics.record_rejected(503)
            raise APIError(503, str(exc)) from None
        except BaseException:
            state.inflight -= 1
            if gen.stream is not None:
                loop.abort(gen.stream)
            raise
        return gen

    # -- consuming outputs
    async def outputs(self) -> AsyncIterator[Any]:
        assert self.stream is not None
        try:
            async for out in self.stream:
                if out.new_token_ids:
                    self.token_ids.extend(out.new_token_ids)
                    self.token_times.extend([out.time_s] * len(out.new_token_ids))
                    if out.logprobs:
                        self.logprobs.extend(out.logprobs)
                self.text_parts.append(out.text_delta)
                if out.finished:
                    self.finish_reason = out.finish_reason or "stop"
                yield out
        finally:
            self.close()

    async def run_to_end(self) -> None:
        async for _ in self.outputs():
            pass

    def abort(self) -> None:
        if self.stream is not None and not self.stream.finished:
            self.state.loop.abort(self.stream)
        if self.finish_reason is None:
            self.finish_reason = "abort"
        self.close()

    def close(self) -> None:
        """Idempotent end of the request: abort if unfinished, record metrics once."""
        if self._recorded:
            return
        self._recorded = True
        if self.finish_reason is None:
            self.finish_reason = "abort"
            if self.stream is not None:
                self.state.loop.abort(self.stream)
        self.state.inflight -= 1
        self.state.metrics.record_request(
            prompt_tokens=len(self.prompt_ids), token_times=self.token_times,
            arrival_s=self.arrival_s, end_s=time.perf_counter(),
            finish_reason=self.finish_reason)

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    def usage(self) -> dict[str, int]:
        return fmt.usage(len(self.prompt_ids), len(self.token_ids))

    def _n_logprobs(self) -> int | None:
        return self.sampling.logprobs

    # -- completions
    def completion_body(self, body: CompletionRequest) -> dict[str, Any]:
        n = self._n_logprobs()
        lp = None if n is None else fmt.completion_logprobs(
            self.token_ids, self.logprobs, n, self.state.token_text, 0)
        return {"id": new_id("cmpl"), "object": "text_completion", "created": self.created,
                "model": body.model,
                "choices": [{"index": 0, "text": self.text, "logprobs": lp,
                             "finish_reason": self.finish_reason, "stop_reason": None}],
                "usage": self.usage()}

    def completion_chunks(self, body: CompletionRequest) -> AsyncIterator[bytes]:
        n, offset = self._n_logprobs(), 0

        def choice(out: Any) -> dict[str, Any]:
            nonlocal offset
            lp = None
            if n is not None and out.logprobs:
                lp = fmt.completion_logprobs(out.new_token_ids, out.logprobs, n,
                                             self.state.token_text, offset)
            offset += len(out.text_delta)
            return {"text": out.text_delta, "logprobs": lp}

        base = {"id": new_id("cmpl"), "object": "text_completion", "created": self.created,
                "model": body.model}
        return self._sse(base, body.include_usage_in_stream, choice)

    # -- chat
    def chat_body(self, body: ChatCompletionRequest) -> dict[str, Any]:
        n = self._n_logprobs()
        lp = None if n is None else {"content": fmt.chat_logprobs(
            self.token_ids, self.logprobs, n, self.state.token_text)}
        return {"id": new_id("chatcmpl"), "object": "chat.completion",
                "created": self.created, "model": body.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text},
                             "logprobs": lp, "finish_reason": self.finish_reason}],
                "usage": self.usage()}

    def chat_chunks(self, body: ChatCompletionRequest) -> AsyncIterator[bytes]:
        n = self._n_logprobs()

        def choice(out: Any) -> dict[str, Any]:
            lp = None
            if n is not None and out.logprobs:
                lp = {"content": fmt.chat_logprobs(out.new_token_ids, out.logprobs, n,
                                                   self.state.token_text)}
            return {"delta": {"content": out.text_delta}, "logprobs": lp}

        base = {"id": new_id("chatcmpl"), "object": "chat.completion.chunk",
                "created": self.created, "model": body.model}
        opening = {**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
        return self._sse(base, body.include_usage_in_stream, choice, opening)

    # -- streaming, shared by both routes
    async def _sse(self, base: dict[str, Any], include_usage: bool,
                   choice: Callable[[Any], dict[str, Any]],
                   opening: dict[str, Any] | None = None) -> AsyncIterator[bytes]:
        """SSE chunks: ``opening``, one per engine output (``choice`` gives its fields),
        the usage chunk when asked for, ``[DONE]``; an engine failure ends the stream with
        an error event. Aborts the request if the client goes away before it finishes."""
        try:
            if opening is not None:
                yield fmt.sse(opening)
            async for out in self.outputs():
                if out.finish_reason == "error":
                    yield _stream_error()
                    break
                yield fmt.sse({**base, "choices": [{
                    "index": 0, **choice(out),
                    "finish_reason": self.finish_reason if out.finished else None}]})
            if include_usage:
                yield fmt.sse({**base, "choices": [], "usage": self.usage()})
            yield fmt.sse("[DONE]")
        finally:
            self.abort() if self.finish_reason is None else self.close()


def _stream_error() -> bytes:
    return fmt.sse(error_body(500, "the engine failed while generating this request; it "
                                   "was aborted (the server keeps serving)"))
