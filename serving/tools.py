"""Tool calling: the tool list in the prompt, the grammar of a forced call, and the parsers
that turn generated text back into OpenAI tool calls, whole or as streamed deltas.

Two call formats (vLLM's ``--tool-call-parser`` names):

* ``hermes`` (Hermes, Qwen 2.5/3): one block per call, possibly after some text,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
* ``llama3_json`` (Llama 3.x): the whole answer is ``{"name": ..., "parameters": {...}}``,
  several calls separated by ``;``.

A template that knows tools (it reads a ``tools`` variable) renders them itself; for one
that does not (SmolLM2's), the tool list goes into the system prompt in the chosen
format's own words, assistant tool calls are written back in that format and tool results
become ``<tool_response>`` user turns (as Qwen's template does).

One incremental parser serves both whole bodies and streams (a body is the stream fed at
once), so streamed deltas always reassemble to the body's calls. The ``arguments`` string
of a call is the raw text of the model's arguments value, streamed as it is generated.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from conflux_jax.grammar import validate
from conflux_jax.sampling import StructuredOutputsParams
from serving.protocol import NamedToolChoice, RequestFieldError, ToolDefinition

TOOL_PARSERS = ("hermes", "llama3_json")

_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_WS = " \t\r\n"


def default_parser(template: str, native_tools: bool) -> str:
    """The parser for a model, judged from its chat template: Llama 3.x's tool-aware
    template speaks ``llama3_json``; every other one (or a template without tools, which
    gets the Hermes prompt) speaks ``hermes``."""
    if native_tools and _HERMES_OPEN not in template and (
            "<|python_tag|>" in template or "<|eot_id|>" in template):
        return "llama3_json"
    return "hermes"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ------------------------------------------------------------------------ the prompt
def _tool_json(tool: dict[str, Any]) -> str:
    return json.dumps(tool, ensure_ascii=False)


def _call_text(parser: str, name: str, arguments: Any) -> str:
    key = "parameters" if parser == "llama3_json" else "arguments"
    obj = json.dumps({"name": name, key: arguments}, ensure_ascii=False)
    return obj if parser == "llama3_json" else f"{_HERMES_OPEN}\n{obj}\n{_HERMES_CLOSE}"


def system_prompt(parser: str, tools: Sequence[dict[str, Any]]) -> str:
    """The tool instructions for a template without tool support (Qwen 2.5's wording for
    ``hermes``; Llama 3.1's JSON prompt for ``llama3_json``)."""
    listing = "\n".join(_tool_json(t) for t in tools)
    if parser == "llama3_json":
        return ("# Tools\n\nYou have access to the following functions:\n\n" + listing +
                "\n\nTo call a function, respond only with a JSON object of the form "
                '{"name": function name, "parameters": dictionary of argument name and its '
                "value}. Do not use variables.")
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{listing}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments "
            "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def prompt_messages(messages: list[dict[str, Any]], parser: str, native: bool,
                    tools: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """``messages`` (OpenAI's, tool calls' arguments already parsed into objects) as the
    template should see them. ``native``: the template renders tools and tool turns itself.
    Otherwise the tool list joins the system prompt and tool turns are spelled out."""
    if native:
        return messages
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_call_text(parser, c["function"]["name"], c["function"]["arguments"])
                     for c in m["tool_calls"]]
            sep = "; " if parser == "llama3_json" else "\n"
            text = "\n".join(x for x in (m.get("content") or "", sep.join(calls)) if x)
            out.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("_tool_turn"):  # consecutive results: one user turn
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_turn": True})
        else:
            out.append({k: v for k, v in m.items() if k not in ("tool_calls", "tool_call_id")})
    for m in out:
        m.pop("_tool_turn", None)
    if tools:
        instructions = system_prompt(parser, tools)
        if out and out[0]["role"] in ("system", "developer"):
            first = dict(out[0])
            first["content"] = f"{first.get('content') or ''}\n\n{instructions}".lstrip()
            out[0] = first
        else:
            out.insert(0, {"role": "system", "content": instructions})
    return out


# ----------------------------------------------------------------------- the grammar
def forced_call_grammar(parser: str, functions: Sequence[dict[str, Any]], *,
                        parallel: bool, strict: bool) -> str:
    """A Lark grammar (llguidance's, with ``%json`` schemas) of one call (or, ``parallel``,
    one or more) to one of ``functions``: each call's arguments valid for its schema, in
    compact JSON."""
    key = "parameters" if parser == "llama3_json" else "arguments"
    rules = []
    for i, fn in enumerate(functions):
        params = fn.get("parameters")
        if params is None:  # OpenAI: no parameters = an empty parameter list
            params = {"type": "object", "properties": {}, "additionalProperties": False}
        schema = {"type": "object",
                  "properties": {"name": {"const": fn["name"]}, key: params},
                  "required": ["name", key], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False, "lenient": not strict}}
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
    if parser == "llama3_json":
        start = 'start: call ("; " call)*' if parallel else "start: call"
        one = ""
    else:
        start = 'start: block ("\\n" block)*' if parallel else "start: block"
        one = 'block: "<tool_call>\\n" call "\\n</tool_call>"\n'
    return f"{start}\n{one}call: {alternatives}\n" + "\n".join(rules) + "\n"


# ------------------------------------------------------------------------ the parser
@dataclasses.dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""

    def message(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclasses.dataclass
class Delta:
    """What one piece of text adds: content, then tool-call deltas in OpenAI's shape."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __iadd__(self, other: Delta) -> Delta:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self


class _ObjectScanner:
    """Follows one JSON object character by character: where its top-level values start
    and end, so the call's name is known once written and its arguments value can be
    streamed while it is written."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.expect = "key"  # at depth 1: key, colon, value, comma
        self.key: str | None = None
        self.key_start = 0
        self.value_start: int | None = None
        self.value_kind = ""  # container, string, scalar
        self.values: dict[str, tuple[int, int | None]] = {}  # key -> (start, end or open)
        self.done = False

    def _end_value(self, end: int) -> None:
        assert self.key is not None and self.value_start is not None
        self.values[self.key] = (self.value_start, end)
        self.value_start, self.expect = None, "comma"

    def push(self, ch: str) -> None:
        i = len(self.text)
        self.text += ch
        if self.in_str:
            if self.esc:
                self.esc = False
            elif ch == "\\":
                self.esc = True
            elif ch == '"':
                self.in_str = False
                if self.depth == 1 and self.expect == "key_str":
                    try:
                        self.key = json.loads(self.text[self.key_start:])
                    except ValueError:
                        self.key = None
                    self.expect = "colon"
                elif self.depth == 1 and self.value_kind == "string":
                    self._end_value(i + 1)
            return
        if self.depth == 0:
            if ch == "{":
                self.depth = 1
            return
        if self.depth == 1:
            if self.expect == "value" and self.value_start is None and ch not in _WS:
                self.value_start = i
                self.values[self.key or ""] = (i, None)
                self.value_kind = ("container" if ch in "{[" else
                                   "string" if ch == '"' else "scalar")
            elif self.value_kind == "scalar" and self.value_start is not None and ch in ",}":
                self._end_value(i)
            if ch == '"':
                self.in_str = True
                if self.expect == "key":
                    self.key_start, self.expect = i, "key_str"
            elif ch == ":" and self.expect == "colon":
                self.expect = "value"
            elif ch == "," and self.expect == "comma":
                self.expect = "key"
            elif ch in "{[":
                self.depth += 1
            elif ch == "}":
                self.depth = 0
                self.done = True
            return
        if ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth == 1 and self.value_kind == "container" and self.value_start is not None:
                self._end_value(i + 1)

    def value(self, key: str) -> str | None:
        span = self.values.get(key)
        if span is None or span[1] is None:
            return None
        return self.text[span[0]:span[1]]


class ToolCallParser:
    """Incremental parser of one choice's output: ``feed`` each text delta, then
    ``finish``; each returns the content and tool-call deltas it adds. ``calls`` and
    ``content`` hold everything so far."""

    def __init__(self, parser: str) -> None:
        if parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r}; choose from "
                             f"{', '.join(TOOL_PARSERS)}")
        self.parser = parser
        self.arg_keys = (("parameters", "arguments") if parser == "llama3_json"
                         else ("arguments", "parameters"))
        self.calls: list[ToolCall] = []
        self.content = ""
        # hermes: text | open (after <tool_call>) | object | close (waiting for </tool_call>)
        # llama3_json: start | object | between (after a call) | text
        self._mode = "start" if parser == "llama3_json" else "text"
        self._pending = ""  # held back: may be the start of the open/close tag
        self._raw = ""  # the current call's text since its tag, for the content fallback
        self._obj: _ObjectScanner | None = None
        self._call: ToolCall | None = None
        self._sent_args = 0  # chars of the current arguments value already streamed

    # -- the public side
    def feed(self, text: str) -> Delta:
        delta = Delta()
        for ch in text:
            self._step(ch, delta)
        self._stream_args(delta)
        self._flush_text(delta, final=False)
        self.content += delta.content
        return delta

    def finish(self) -> Delta:
        """End of output: an unfinished call is kept if it got its name (its arguments are
        whatever was generated: a truncated call), otherwise its text is content."""
        delta = Delta()
        if self._mode == "object":
            self._end_object(delta, complete=False)
        elif self._mode == "open":
            delta.content += self._raw
            self._raw, self._mode = "", "text"
        self._flush_text(delta, final=True)
        self.content += delta.content
        return delta

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output: its content and calls."""
        self.feed(text)
        self.finish()
        return self.content, self.calls

    # -- the machine
    def _step(self, ch: str, delta: Delta) -> None:
        mode = self._mode
        if mode == "text":
            self._pending += ch
            if self.parser == "hermes":
                at = self._pending.find(_HERMES_OPEN)
                if at >= 0:
                    before = self._pending[:at]
                    if not self.calls or before.strip(_WS):  # blank between calls: none
                        delta.content += before
                    self._pending, self._raw, self._mode = "", _HERMES_OPEN, "open"
        elif mode in ("start", "between"):
            if ch in _WS or (mode == "between" and ch == ";"):
                self._raw += ch
            elif ch == "{":
                self._begin_object(ch)
            else:  # not a call: the rest is content
                self._pending, self._raw = self._raw + ch, ""
                self._mode = "text"
        elif mode == "open":
            self._raw += ch
            if ch == "{":
                self._begin_object(ch)
            elif ch not in _WS:  # not a call: the tag and all are content
                delta.content += self._raw
                self._raw, self._mode = "", "text"
        elif mode == "object":
            assert self._obj is not None
            self._raw += ch
            self._obj.push(ch)
            if self._call is None:
                self._announce(delta)
            if self._obj.done:
                self._end_object(delta, complete=True)
        elif mode == "close":
            self._pending += ch
            stripped = self._pending.lstrip(_WS)
            if stripped.startswith(_HERMES_CLOSE):
                self._pending = stripped[len(_HERMES_CLOSE):]
                self._mode = "text"
            elif not _HERMES_CLOSE.startswith(stripped):  # no closing tag: back to text
                self._mode = "text"

    def _begin_object(self, ch: str) -> None:
        if self.parser == "llama3_json":  # hermes keeps its tag for the content fallback
            self._raw = ch
        self._obj, self._call, self._sent_args = _ObjectScanner(), None, 0
        self._mode = "object"
        self._obj.push(ch)

    def _announce(self, delta: Delta) -> None:
        """Open the call once its name is written (OpenAI's first delta of a call)."""
        assert self._obj is not None
        raw_name = self._obj.value("name")
        if raw_name is None:
            return
        try:
            name = json.loads(raw_name)
        except ValueError:
            return
        if not isinstance(name, str) or not name:
            return
        self._call = ToolCall(new_call_id(), name)
        self.calls.append(self._call)
        delta.tool_calls.append({"index": len(self.calls) - 1, "id": self._call.id,
                                 "type": "function",
                                 "function": {"name": name, "arguments": ""}})

    def _args_span(self) -> tuple[int, int | None] | None:
        assert self._obj is not None
        for key in self.arg_keys:
            if key in self._obj.values:
                return self._obj.values[key]
        return None

    def _stream_args(self, delta: Delta) -> None:
        if self._call is None or self._obj is None or self._mode != "object":
            return
        span = self._args_span()
        if span is None:
            return
        start, end = span
        end = len(self._obj.text) if end is None else end
        self._emit_args(delta, self._obj.text[start + self._sent_args:end])

    def _emit_args(self, delta: Delta, piece: str) -> None:
        if not piece or self._call is None:
            return
        self._sent_args += len(piece)
        self._call.arguments += piece
        delta.tool_calls.append({"index": len(self.calls) - 1,
                                 "function": {"arguments": piece}})

    def _end_object(self, delta: Delta, *, complete: bool) -> None:
        obj = self._obj
        assert obj is not None
        if self._call is None:
            self._announce(delta)
        if self._call is None:  # no name: it was not a call after all
            delta.content += self._raw
            self._mode = "text"
        else:
            self._stream_args(delta)
            if complete and self._args_span() is None:
                self._emit_args(delta, "{}")
            self._mode = "close" if self.parser == "hermes" else "between"
        self._obj, self._call, self._raw = None, None, ""

    def _flush_text(self, delta: Delta, *, final: bool) -> None:
        """Hand out held-back text that is surely content."""
        if self._mode == "close" or not self._pending:
            if final:  # a missing or cut closing tag is not content
                self._pending = ""
            return
        if self._mode != "text":
            return
        keep = 0
        if not final and self.parser == "hermes":
            # Hold back a tail that could still become "<tool_call>".
            for n in range(min(len(_HERMES_OPEN) - 1, len(self._pending)), 0, -1):
                if _HERMES_OPEN.startswith(self._pending[-n:]):
                    keep = n
                    break
        cut = len(self._pending) - keep
        if self.calls and not self._pending[:cut].strip(_WS):
            # Blank text between or after calls is not content (a final blank is dropped).
            if final:
                self._pending = ""
            return
        delta.content += self._pending[:cut]
        self._pending = self._pending[cut:]


ParserFactory = Callable[[], ToolCallParser]


# ------------------------------------------------------------------ a request's plan
@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools: the tool list the prompt shows (empty for
    ``tool_choice="none"``), the output parser, and the grammar that forces a call
    (``required`` or a named function), if any."""

    parser: str
    tools: list[dict[str, Any]]
    grammar: str | None

    def parser_factory(self) -> ParserFactory | None:
        if not self.tools:  # "none": the answer is text, never parsed for calls
            return None
        return lambda: ToolCallParser(self.parser)


def plan_tools(tools: Sequence[ToolDefinition] | None,
               tool_choice: str | NamedToolChoice | None, parallel: bool | None,
               parser: str) -> ToolPlan | None:
    """The request's :class:`ToolPlan`, or None when it has no tools. Raises
    :class:`RequestFieldError` naming ``tools`` or ``tool_choice`` for what cannot be
    served: an invalid schema, duplicate names, a choice without tools or naming none."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise RequestFieldError("tool_choice needs tools", "tool_choice")
        if tools is not None:
            raise RequestFieldError("tools must list at least one tool (or be omitted)",
                                    "tools")
        return None
    functions = [t.function for t in tools]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise RequestFieldError("tool function names must be unique", "tools")
    for f in functions:
        if f.parameters is not None:
            try:
                validate(StructuredOutputsParams(json=f.parameters, strict=f.strict is not False))
            except ValueError as exc:
                raise RequestFieldError(f"tools: function {f.name!r}: {exc}", "tools") from None
    listed = [t.model_dump(exclude_none=True) for t in tools]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan(parser, [], None)
    if choice == "auto":
        return ToolPlan(parser, listed, None)
    if isinstance(choice, NamedToolChoice):
        forced = [d for d in listed if d["function"]["name"] == choice.function.name]
        if not forced:
            raise RequestFieldError(f"tool_choice names {choice.function.name!r}, which is "
                                    "not among the tools", "tool_choice")
        many = False
    else:  # required: one call (or, unless parallel_tool_calls is false, several)
        forced, many = listed, parallel is not False
    fns = [d["function"] for d in forced]
    grammar = forced_call_grammar(parser, fns, parallel=many,
                                  strict=all(f.get("strict") is not False for f in fns))
    return ToolPlan(parser, listed, grammar)
