"""The FastAPI app: OpenAI routes over one ``EngineLoop``.

A generation route validates (pydantic), checks the model name, tokenizes here (so usage
counts and the engine see the same ids), builds the ``SamplingParams`` and the response
shape, and hands the rest of the request's life to ``request_flow.serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conflux_jax.sampling import SamplingParams
from serving import formatting as fmt
from serving.auth import ApiKeyMiddleware
from serving.engine_loop import EngineLoop
from serving.errors import APIError, error_body, install_error_handlers
from serving.limits import BodySizeLimitMiddleware
from serving.metrics import Metrics
from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    ModelCard,
    ModelList,
    to_sampling_params,
)
from serving.request_flow import serve
from serving.settings import ServerSettings, ServerState


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
        sampling = _sampling(state, body)
        form = fmt.CompletionFormat(body.model, sampling.logprobs, state.token_text)
        return await serve(state, request, body, ids, sampling, form)

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
        sampling = _sampling(state, body)
        form = fmt.ChatFormat(body.model, sampling.logprobs, state.token_text)
        return await serve(state, request, body, ids, sampling, form)

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


def _sampling(state: ServerState, body: GenerationRequest) -> SamplingParams:
    """``to_sampling_params`` with its refusals as 400s; checks what this server computes."""
    limit, wanted = state.settings.max_logprobs, body.num_logprobs
    if wanted and wanted > limit:
        raise APIError(400, f"this server returns at most {limit} top logprobs per token "
                            "(start it with a larger --max-logprobs)", param="logprobs")
    try:
        return to_sampling_params(body)
    except ValueError as exc:
        raise APIError(400, str(exc), param=getattr(exc, "param", None)) from None
