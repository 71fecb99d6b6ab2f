"""OpenAI response bodies built from engine outputs: whole bodies, SSE chunks, logprobs,
usage. Pure shaping: nothing here submits, waits for or aborts a request."""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING, Any, ClassVar

from serving.errors import ENGINE_FAILED, error_body
from serving.protocol import new_id
from serving.tools import ParserFactory, ToolCallParser

if TYPE_CHECKING:
    from conflux_jax.engine import StepOutput

# JSON has no -inf; vLLM reports this floor instead, and so do we.
_LOGPROB_FLOOR = -9999.0


def clean_logprob(x: float) -> float:
    return _LOGPROB_FLOOR if not math.isfinite(x) or x < _LOGPROB_FLOOR else float(x)


class TokenText:
    """Token id -> display string (cached; decoding one id at a time is per-token work)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._cache[token_id] = s
        return s


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, float]], n: int,
                        text: TokenText, offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object for ``token_ids`` (one entry each)."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}
    for tid, entry in zip(token_ids, entries, strict=False):
        s = text(tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(clean_logprob(entry.get(tid, -math.inf)))
        top: dict[str, float] = {}
        for t, lp in _top(entry, n):  # ids that decode alike keep the likelier one
            top.setdefault(text(t), clean_logprob(lp))
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, float]], n: int,
                  text: TokenText) -> list[dict[str, Any]]:
    """The chat ``logprobs.content`` list for ``token_ids``."""
    content = []
    for tid, entry in zip(token_ids, entries, strict=False):
        s = text(tid)
        content.append({
            "token": s, "logprob": clean_logprob(entry.get(tid, -math.inf)),
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": text(t), "logprob": clean_logprob(lp),
                              "bytes": list(text(t).encode("utf-8"))}
                             for t, lp in _top(entry, n)]})
    return content


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def sse(payload: dict[str, Any] | str) -> bytes:
    # ASCII-only JSON: raw U+2028, U+0085 or \x1c in generated text are line breaks to
    # clients that split lines like str.splitlines (httpx's iter_lines), breaking events.
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=True)
    return f"data: {data}\n\n".encode()


def now_s() -> int:
    return int(time.time())


# ------------------------------------------------------------------------------ bodies
class ResponseFormat:
    """One response's OpenAI shape: the whole body, or its SSE events in order. Made once
    per request, so one id spans every chunk of a stream."""

    id_prefix: ClassVar[str]
    body_object: ClassVar[str]
    chunk_object: ClassVar[str]

    def __init__(self, model: str, n_logprobs: int | None, token_text: TokenText) -> None:
        self.model = model
        self.n_logprobs = n_logprobs  # None: the client asked for no logprobs
        self.token_text = token_text
        self.id = new_id(self.id_prefix)
        self.created = now_s()
        # vLLM's return_token_ids: the prompt's ids in the body, each choice's (or chunk's).
        self.prompt_token_ids: list[int] | None = None

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def body(self, choices: list[dict[str, Any]], usage: dict[str, int]) -> dict[str, Any]:
        """The non-streaming body of ``choices`` (from :meth:`choice`)."""
        body = {**self._head(self.body_object), "choices": choices, "usage": usage}
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
        return body

    def with_ids(self, choice: dict[str, Any], token_ids: list[int]) -> dict[str, Any]:
        if self.prompt_token_ids is not None:
            choice["token_ids"] = list(token_ids)
        return choice

    def choice(self, index: int, text: str, token_ids: list[int],
               entries: list[dict[int, float]], finish_reason: str | None) -> dict[str, Any]:
        """One choice of the non-streaming body; ``entries`` are the logprobs of
        ``token_ids``."""
        raise NotImplementedError

    def opening(self, index: int = 0) -> bytes | None:
        """The event sent before any output of choice ``index``, if this endpoint has one."""
        return None

    def chunk(self, out: StepOutput, finish_reason: str | None, index: int = 0) -> bytes:
        return sse({**self._head(self.chunk_object), "choices": [self.with_ids({
            "index": index, **self._delta(out, index), "finish_reason": finish_reason},
            out.new_token_ids)]})

    def usage_chunk(self, usage: dict[str, int]) -> bytes:
        return sse({**self._head(self.chunk_object), "choices": [], "usage": usage})

    @staticmethod
    def done() -> bytes:
        return sse("[DONE]")

    @staticmethod
    def engine_failed() -> bytes:
        """The event that ends a stream whose request the engine failed."""
        return sse(error_body(500, ENGINE_FAILED))

    def _delta(self, out: StepOutput, index: int) -> dict[str, Any]:
        """A chunk's choice fields for one engine output (all but index, finish_reason)."""
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    """``/v1/completions``: ``text`` plus the legacy ``logprobs`` object."""

    id_prefix = "cmpl"
    body_object = chunk_object = "text_completion"

    def __init__(self, model: str, n_logprobs: int | None, token_text: TokenText,
                 echo: str | None = None) -> None:
        super().__init__(model, n_logprobs, token_text)
        self.echo = echo  # the prompt text every choice starts with (echo=true)
        # Per choice: text offset of its next chunk (legacy logprobs' text_offset).
        self._offset: dict[int, int] = {}

    def choice(self, index: int, text: str, token_ids: list[int],
               entries: list[dict[int, float]], finish_reason: str | None) -> dict[str, Any]:
        n = self.n_logprobs
        lp = None if n is None else completion_logprobs(token_ids, entries, n,
                                                        self.token_text, 0)
        return self.with_ids({"index": index, "text": (self.echo or "") + text, "logprobs": lp,
                              "finish_reason": finish_reason, "stop_reason": None}, token_ids)

    def opening(self, index: int = 0) -> bytes | None:
        if self.echo is None:
            return None
        return sse({**self._head(self.chunk_object), "choices": [{
            "index": index, "text": self.echo, "logprobs": None, "finish_reason": None}]})

    def _delta(self, out: StepOutput, index: int) -> dict[str, Any]:
        lp = None
        offset = self._offset.get(index, 0)
        if self.n_logprobs is not None and out.logprobs:
            lp = completion_logprobs(out.new_token_ids, out.logprobs, self.n_logprobs,
                                     self.token_text, offset)
        self._offset[index] = offset + len(out.text_delta)
        return {"text": out.text_delta, "logprobs": lp}


class ChatFormat(ResponseFormat):
    """``/v1/chat/completions``: an assistant message, or deltas after a role chunk.

    With ``tool_parser`` (a request with tools), each choice's text goes through its own
    parser: calls become ``message.tool_calls`` (streamed: ``delta.tool_calls`` events, the
    call's name first, then its arguments as they are generated) and a choice that called
    a tool and stopped says ``finish_reason: "tool_calls"``.
    """

    id_prefix = "chatcmpl"
    body_object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, model: str, n_logprobs: int | None, token_text: TokenText,
                 tool_parser: ParserFactory | None = None) -> None:
        super().__init__(model, n_logprobs, token_text)
        self._tool_parser = tool_parser
        self._parsers: dict[int, ToolCallParser] = {}  # per choice, while streaming

    def _logprobs(self, token_ids: list[int],
                  entries: list[dict[int, float]]) -> dict[str, Any] | None:
        if self.n_logprobs is None:
            return None
        return {"content": chat_logprobs(token_ids, entries, self.n_logprobs, self.token_text)}

    @staticmethod
    def _finish(reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" else reason

    def choice(self, index: int, text: str, token_ids: list[int],
               entries: list[dict[int, float]], finish_reason: str | None) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if self._tool_parser is not None:
            content, calls = self._tool_parser().parse(text)
            message = {"role": "assistant", "content": content or (None if calls else ""),
                       "tool_calls": [c.message() for c in calls]}
            finish_reason = self._finish(finish_reason, bool(calls))
        return self.with_ids({"index": index, "message": message,
                              "logprobs": self._logprobs(token_ids, entries),
                              "finish_reason": finish_reason}, token_ids)

    def _delta(self, out: StepOutput, index: int) -> dict[str, Any]:
        lp = self._logprobs(out.new_token_ids, out.logprobs) if out.logprobs else None
        return {"delta": {"content": out.text_delta}, "logprobs": lp}

    def chunk(self, out: StepOutput, finish_reason: str | None, index: int = 0) -> bytes:
        if self._tool_parser is None:
            return super().chunk(out, finish_reason, index)
        parser = self._parsers.get(index)
        if parser is None:
            parser = self._parsers[index] = self._tool_parser()
        delta = parser.feed(out.text_delta)
        if out.finished:
            delta += parser.finish()
        lp = self._logprobs(out.new_token_ids, out.logprobs) if out.logprobs else None
        # One event per piece, as OpenAI streams them: content, then each call delta.
        pieces: list[dict[str, Any]] = []
        if delta.content or lp is not None:
            pieces.append({"content": delta.content})
        pieces += [{"tool_calls": [tc]} for tc in delta.tool_calls]
        if finish_reason is not None and not pieces:
            pieces.append({})
        events = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            events.append(sse({**self._head(self.chunk_object), "choices": [self.with_ids({
                "index": index, "delta": piece, "logprobs": lp if i == 0 else None,
                "finish_reason": self._finish(finish_reason, bool(parser.calls))
                if last else None}, out.new_token_ids if i == 0 else [])]}))
        return b"".join(events)

    def opening(self, index: int = 0) -> bytes:
        return sse({**self._head(self.chunk_object), "choices": [{
            "index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
            "finish_reason": None}]})
