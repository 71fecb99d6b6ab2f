"""Per-request output bookkeeping on the host: detokenize, stop, report.

One ``OutputTracker`` per request turns sampled token ids into text increments and
decides when the request is finished (EOS, stop token, stop string, max_tokens, context
limit). Every generation path (the reference generator, the engine) uses it, so stop
semantics are defined once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from conflux_jax.sampling import SamplingParams


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None  # per token: {token_id: logprob}
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)


class OutputTracker:
    """Accumulates one request's output tokens and text; decides when it is finished."""

    def __init__(self, tokenizer: Any, params: SamplingParams, max_new_tokens: int):
        from conflux_jax.tokenizer import IncrementalDecoder

        self.params = params
        self.max_new_tokens = max_new_tokens  # max_tokens, capped by the context length
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self._decoder = IncrementalDecoder(tokenizer,
                                           skip_special_tokens=params.skip_special_tokens)
        self._text = ""
        self._emitted = 0  # chars of _text already handed out as deltas
        self._stop_ids = set(params.stop_token_ids or ())
        if not params.ignore_eos:
            self._stop_ids |= set(tokenizer.eos_token_ids)
        self._stops = params.stop_strings
        self._min_tokens = params.min_tokens
        # Streaming holds back a tail that could still become a stop string.
        self._holdback = max((len(s) for s in self._stops), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return self._text

    def stops_at(self, token_id: int) -> bool:
        """Whether appending ``token_id`` next would end the request on a stop token (the
        first thing ``append`` decides, before any text)."""
        return token_id in self._stop_ids and len(self.token_ids) >= self._min_tokens

    def append(self, token_id: int, logprob: float | None = None,
               top: dict[int, float] | None = None) -> str:
        """Add one sampled token; return the new text that is safe to stream."""
        if self.finish_reason is not None:
            raise RuntimeError("append() on a finished request")
        ids = self.token_ids
        ids.append(token_id)
        if logprob is not None:
            self.cumulative_logprob += logprob
        if self.logprobs is not None:
            entry = dict(top or {})
            if logprob is not None:
                entry[token_id] = logprob
            self.logprobs.append(entry)
        # Below min_tokens nothing stops the request but its length (vLLM's rule; the
        # stop tokens are masked out on the device meanwhile).
        may_stop = len(ids) > self._min_tokens
        if token_id in self._stop_ids and may_stop:
            self.finish_reason, self.stop_reason = "stop", token_id
        else:
            chunk = self._decoder.push(token_id)
            if chunk:
                self._text += chunk
            if may_stop and self._stops:
                self._check_stop_strings()
        if self.finish_reason is None:
            if len(ids) < self.max_new_tokens:
                return self._take_delta()  # the common case: the request goes on
            self.finish_reason = "length"
        if not isinstance(self.stop_reason, str):
            self._text += self._decoder.flush()  # a stop string already cut the text
        return self._take_delta()

    def stop(self) -> str:
        """Finish with "stop" after the last token (its grammar is complete); returns the
        rest of the text."""
        if not self.finished:
            self.finish_reason = "stop"
            self._text += self._decoder.flush()
        return self._take_delta()

    def abort(self, reason: str = "abort") -> str:
        if not self.finished:
            self.finish_reason = reason
        return self._take_delta()

    def _check_stop_strings(self) -> None:
        # Only the newly added tail can complete a stop string.
        window_start = max(0, self._emitted - self._holdback - 1)
        best: tuple[int, str] | None = None
        for s in self._stops:
            at = self._text.find(s, window_start)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            at, s = best
            self._text = self._text[: at + len(s)] if self.params.include_stop_str_in_output \
                else self._text[:at]
            self.finish_reason, self.stop_reason = "stop", s

    def _take_delta(self) -> str:
        end = len(self._text) if self.finish_reason is not None else \
            max(self._emitted, len(self._text) - self._holdback)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta

    def completion(self, index: int = 0) -> CompletionOutput:
        return CompletionOutput(
            index=index, text=self._text, token_ids=list(self.token_ids),
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs, finish_reason=self.finish_reason,
            stop_reason=self.stop_reason)
