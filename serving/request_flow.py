"""One request's life on the HTTP side, between the routes and the ``EngineLoop``.

Admission (503 while the loop is not ready, 429 when ``max_queue`` requests are in flight,
400 / 503 when the loop refuses it), then either an SSE stream of its ``StepOutput``s or
one collected body. A request whose client goes away (stream closed, or a non-streaming
client disconnecting) is aborted so its KV pages are freed, and every admitted request
records its metrics exactly once when it ends. Behind the global router
(``serving.routed_loop``) the response names the instance that served it
(``x-conflux-instance``), and a request whose instance fails mid-way ends with an error
naming that failure (``GenerationFailed``: an error event, or a 502 when not streaming).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from conflux_jax.engine import EngineError, StepOutput
from conflux_jax.sampling import SamplingParams
from serving import formatting as fmt
from serving.engine_loop import EngineLoopClosed, GenerationFailed, RequestStream
from serving.errors import ENGINE_FAILED, APIError, error_body
from serving.protocol import GenerationRequest
from serving.settings import ServerState


async def serve(state: ServerState, request: Request, body: GenerationRequest,
                prompt_ids: list[int], sampling: SamplingParams,
                form: fmt.ResponseFormat) -> Response:
    """Admit the request, then answer it as an SSE stream or one JSON body."""
    gens = await _start_choices(state, prompt_ids, sampling, body)
    headers = _served_by(gens)
    if body.stream:
        return _SSEResponse(gens, _events(gens, form, body.include_usage_in_stream), headers)
    return JSONResponse(await _collect(gens, request, form), headers=headers)


INSTANCE_HEADER = "x-conflux-instance"


def _served_by(gens: list[Generation]) -> dict[str, str]:
    """The instances that serve the choices, in order (none for a single engine)."""
    names = dict.fromkeys(g.stream.served_by for g in gens
                          if g.stream is not None and g.stream.served_by)
    return {INSTANCE_HEADER: ",".join(names)} if names else {}


async def _start_choices(state: ServerState, prompt_ids: list[int], sampling: SamplingParams,
                         body: GenerationRequest) -> list[Generation]:
    """One engine request per choice (``n``), all sharing the prompt. With a seed, choice
    i samples with ``seed + i`` (as vLLM does), so each is reproducible and they differ."""
    gens: list[Generation] = []
    try:
        for i in range(sampling.n):
            seed = None if sampling.seed is None else sampling.seed + i
            child = dataclasses.replace(sampling, n=1, seed=seed)
            gens.append(await Generation.start(state, prompt_ids, child, body))
    except BaseException:
        for g in gens:
            g.abort()
        raise
    return gens


def _usage(gens: list[Generation]) -> dict[str, Any]:
    return fmt.usage(len(gens[0].prompt_ids), sum(len(g.token_ids) for g in gens),
                     gens[0].cached_tokens)


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, StepOutput]]:
    """Every choice's outputs as they come, tagged with the choice index."""
    if len(gens) == 1:
        async for out in gens[0].outputs():
            yield 0, out
        return
    queue: asyncio.Queue[tuple[int, StepOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for out in gen.outputs():
                queue.put_nowait((i, out))
        except Exception as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class Generation:
    """One admitted request: what it produced so far, and its abort / metrics bookkeeping."""

    def __init__(self, state: ServerState, prompt_ids: list[int]) -> None:
        self.state = state
        self.prompt_ids = prompt_ids
        self.arrival_s = time.perf_counter()
        self.token_ids: list[int] = []
        self.token_times: list[float] = []
        self.logprobs: list[dict[int, float]] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        self.cached_tokens = 0  # prompt tokens the prefix cache served
        self.stream: RequestStream | None = None
        self._recorded = False

    @classmethod
    async def start(cls, state: ServerState, ids: list[int], sampling: SamplingParams,
                    body: GenerationRequest) -> Generation:
        # Read per request, not captured at start-up: settings may be swapped while live.
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
        gen = cls(state, ids)
        slo: dict[str, float] = {}
        if body.ttft_slo_ms is not None:
            slo["ttft_slo_s"] = body.ttft_slo_ms / 1000.0
        if body.tbt_slo_ms is not None:
            slo["tbt_slo_s"] = body.tbt_slo_ms / 1000.0
        extra: dict[str, Any] = {"cache_salt": body.cache_salt} if body.cache_salt else {}
        state.inflight += 1
        try:
            gen.stream = loop.submit(ids, sampling, **slo, **extra)
            await gen.stream.accepted
        except (EngineError, ValueError) as exc:
            state.inflight -= 1
            state.metrics.record_rejected(400)
            raise APIError(400, str(exc), param=getattr(exc, "param", "prompt")) from None
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
    async def outputs(self) -> AsyncIterator[StepOutput]:
        assert self.stream is not None
        try:
            async for out in self._stream_outputs():
                if out.num_cached_tokens is not None:
                    self.cached_tokens = out.num_cached_tokens
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

    async def _stream_outputs(self) -> AsyncIterator[StepOutput]:
        assert self.stream is not None
        try:
            async for out in self.stream:
                yield out
        except GenerationFailed:
            self.finish_reason = "error"  # recorded as an engine failure, not an abort
            raise

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


# ------------------------------------------------------------------------ non-streaming
async def _collect(gens: list[Generation], request: Request,
                   form: fmt.ResponseFormat) -> dict[str, Any]:
    """Run a non-streaming request's choices to the end, aborting them if the client
    disconnects."""
    runs = [asyncio.ensure_future(g.run_to_end()) for g in gens]
    task = asyncio.ensure_future(asyncio.gather(*runs))
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                try:
                    task.result()
                except GenerationFailed as exc:
                    for run in runs:  # gather leaves the other choices running
                        run.cancel()
                    raise APIError(502, str(exc)) from None
                break
            if await request.is_disconnected():
                task.cancel()
                for g in gens:
                    g.abort()
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()
            for g in gens:
                g.abort()
    if any(g.finish_reason == "error" for g in gens):
        raise APIError(500, ENGINE_FAILED)
    return form.body([form.choice(i, g.text, g.token_ids, g.logprobs, g.finish_reason)
                      for i, g in enumerate(gens)], _usage(gens))


# ---------------------------------------------------------------------------- streaming
class _SSEResponse(StreamingResponse):
    """SSE stream that always ends its requests: a client gone before the first chunk
    never runs the chunk generator (so its ``finally`` never runs); this ``finally`` does."""

    def __init__(self, gens: list[Generation], chunks: AsyncIterator[bytes],
                 headers: dict[str, str]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                                  **headers})
        self._gens = gens

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for g in self._gens:
                g.abort()  # no-op for a request that finished


async def _events(gens: list[Generation], form: fmt.ResponseFormat,
                  include_usage: bool) -> AsyncIterator[bytes]:
    """SSE events: the opening ones, one per engine output (tagged with its choice), the
    usage chunk when asked for, ``[DONE]``; an engine failure ends the stream with an
    error event. Aborts the requests if the client goes away before they finish."""
    try:
        for i in range(len(gens)):
            opening = form.opening(i)
            if opening is not None:
                yield opening
        try:
            async for i, out in _merged(gens):
                if out.finish_reason == "error":
                    yield form.engine_failed()
                    break
                yield form.chunk(out, gens[i].finish_reason if out.finished else None, i)
        except GenerationFailed as exc:  # its instance failed: say so, as engine_failed
            yield fmt.sse(error_body(502, str(exc)))
        if include_usage:
            yield form.usage_chunk(_usage(gens))
        yield form.done()
    finally:
        for g in gens:
            g.abort() if g.finish_reason is None else g.close()
