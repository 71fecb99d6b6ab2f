"""The FastAPI app: OpenAI routes over one ``EngineLoop``.

A generation route validates (pydantic), checks the model name, tokenizes here (so usage
counts and the engine see the same ids), builds the ``SamplingParams`` and the response
shape, and hands the rest of the request's life to ``request_flow.serve``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib.metadata
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conflux_jax.sampling import SamplingParams, StructuredOutputsParams
from serving import formatting as fmt
from serving import tools
from serving.auth import ApiKeyMiddleware
from serving.engine_loop import EngineLoop
from serving.errors import APIError, error_body, install_error_handlers
from serving.limits import BodySizeLimitMiddleware
from serving.metrics import Metrics
from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerationRequest,
    ModelCard,
    ModelList,
    RequestFieldError,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
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
    if settings.chat_template is not None:
        tokenizer = tokenizer.with_chat_template(settings.chat_template)
    tool_parser = settings.tool_call_parser or tools.default_parser(
        tokenizer.chat_template, tokenizer.supports_tools)
    if tool_parser not in tools.TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {tool_parser!r}; choose from "
                         f"{', '.join(tools.TOOL_PARSERS)}")
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
            ids = await _encode(tokenizer, body.prompt,
                                add_special_tokens=body.add_special_tokens)
        else:
            ids = [int(t) for t in body.prompt]  # type: ignore[union-attr]
        kept = _truncate(ids, body.truncate_prompt_tokens)
        sampling = _sampling(state, body)
        echo = None
        if body.echo:  # the prompt as the model saw it (decoded if given as ids or cut)
            echo = body.prompt if isinstance(body.prompt, str) and kept is ids else \
                tokenizer.decode(kept, skip_special_tokens=sampling.skip_special_tokens)
        form = fmt.CompletionFormat(body.model, sampling.logprobs, state.token_text, echo=echo)
        _name(form, body, kept)
        return await serve(state, request, body, kept, sampling, form)

    async def chat_prompt(body: ChatCompletionRequest) -> tuple[list[int], tools.ToolPlan | None]:
        """The prompt ids of a chat request (its template, tools, documents, continuation,
        truncation) and how it uses its tools."""
        try:
            plan = tools.plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                                    tool_parser)
        except RequestFieldError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
        messages = _chat_messages(body)
        template_kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
        if body.documents is not None:
            template_kwargs["documents"] = body.documents
        if plan is not None:
            if plan.tools and tokenizer.supports_tools:
                template_kwargs["tools"] = plan.tools
            # With tool_choice none, earlier tool turns still need words.
            messages = tools.prompt_messages(messages, tool_parser, tokenizer.supports_tools,
                                             plan.tools or None)
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt, **template_kwargs)
        except ValueError as exc:  # TokenizerError is a ValueError
            raise APIError(400, f"could not apply the chat template: {exc}",
                           param="messages") from None
        if body.continue_final_message:
            text = _continue_final(text, messages[-1].get("content") or "")
        # The template already places any BOS; encoding adds another only if asked to.
        ids = await _encode(tokenizer, text, add_special_tokens=body.add_special_tokens)
        return _truncate(ids, body.truncate_prompt_tokens), plan

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(state, body.model)
        ids, plan = await chat_prompt(body)
        sampling = _sampling(state, body)
        if plan is not None and plan.grammar is not None:
            if sampling.structured_outputs is not None:
                raise APIError(400, "a forced tool call (tool_choice required or a named "
                                    "function) cannot also take an output constraint",
                               param="tool_choice")
            sampling = dataclasses.replace(
                sampling, structured_outputs=StructuredOutputsParams(grammar=plan.grammar))
        form = fmt.ChatFormat(body.model, sampling.logprobs, state.token_text,
                              tool_parser=plan.parser_factory() if plan else None)
        _name(form, body, ids)
        try:
            return await serve(state, request, body, ids, sampling, form)
        except APIError as exc:
            if plan is not None and plan.grammar is not None and \
                    exc.param == "structured_outputs":  # the forced call's grammar
                raise APIError(400, exc.message, param="tools") from None
            raise

    # vLLM's small endpoints (at the root, as vLLM serves them).
    @app.post("/tokenize")
    async def tokenize(body: TokenizeCompletionRequest | TokenizeChatRequest) -> Response:
        if body.model is not None:
            _check_model(state, body.model)
        if isinstance(body, TokenizeChatRequest):
            chat_body = ChatCompletionRequest(
                model=settings.model_name,
                **body.model_dump(exclude={"model", "return_token_strs"}, exclude_unset=True))
            ids, _ = await chat_prompt(chat_body)
        else:
            ids = await _encode(tokenizer, body.prompt,
                                add_special_tokens=body.add_special_tokens)
        strs = [state.token_text(t) for t in ids] if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": settings.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        if body.model is not None:
            _check_model(state, body.model)
        vocab = loop.engine.model_config.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return JSONResponse({"prompt": tokenizer.decode(body.tokens)})

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": _version()})

    return app


# ------------------------------------------------------------------------------- checks
async def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool) -> list[int]:
    # A long prompt (up to the body limit) would stall every stream on this event loop.
    if len(text) < 4096:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text,
                                   add_special_tokens=add_special_tokens)


def _version() -> str:
    try:
        return importlib.metadata.version("conflux_jax")
    except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
        return "0+unknown"


def _truncate(ids: list[int], keep: int | None) -> list[int]:
    """vLLM's truncate_prompt_tokens: only the last ``keep`` prompt tokens."""
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def _continue_final(text: str, final: str) -> str:
    """The rendered prompt cut right after the final message's content, so the model
    continues that message instead of closing its turn (vLLM's continue_final_message)."""
    at = text.rfind(final) if final else -1
    if at < 0:
        raise APIError(400, "continue_final_message: the chat template does not render the "
                            "final message's content verbatim", param="continue_final_message")
    return text[:at + len(final)]


def _name(form: fmt.ResponseFormat, body: GenerationRequest, prompt_ids: list[int]) -> None:
    """vLLM's request_id names the response; return_token_ids adds the ids."""
    if body.request_id is not None:
        form.id = f"{form.id_prefix}-{body.request_id}"
    if body.return_token_ids:
        form.prompt_token_ids = list(prompt_ids)


def _chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as the template sees it: text content, and earlier tool calls'
    arguments as objects (what HF tool-aware templates expect, as vLLM passes them)."""
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(body.messages):
        try:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
        except ValueError as exc:
            raise APIError(400, f"messages.{i}: {exc}", param="messages") from None
        if m.name:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            calls = []
            for c in m.tool_calls:
                try:
                    args = json.loads(c.function.arguments)
                except ValueError:
                    raise APIError(400, f"messages.{i}.tool_calls: the arguments of "
                                        f"{c.function.name!r} are not JSON",
                                   param="messages") from None
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            d["tool_calls"] = calls
        messages.append(d)
    return messages


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
