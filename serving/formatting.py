"""OpenAI response pieces built from engine outputs: logprobs, chunks, usage."""

from __future__ import annotations

import json
import math
import time
from typing import Any

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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(payload: dict[str, Any] | str) -> bytes:
    # ASCII-only JSON: raw U+2028, U+0085 or \x1c in generated text are line breaks to
    # clients that split lines like str.splitlines (httpx's iter_lines), breaking events.
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=True)
    return f"data: {data}\n\n".encode()


def now_s() -> int:
    return int(time.time())
