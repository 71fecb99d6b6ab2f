"""Tool calling through the real ``openai`` client, and the tool-call parsers.

The tiny model is random, so a valid call under ``tool_choice="required"`` or a named
function is the grammar's doing. Its byte-level tokenizer would make the Hermes system
prompt overflow its 256-token context, so its server renders tools with a compact
tool-aware template (``--chat-template``); the Hermes fallback prompt is checked by
rendering, and end to end on SmolLM2 (whose template knows no tools). Oracles:
``jsonschema`` over the schema the client sent, OpenAI's own client-side accumulation of
streamed tool-call deltas, hand-written expected calls for the parsers.
"""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serving_helpers import TOOL_TEMPLATE

from serving.tools import ToolCallParser, default_parser, prompt_messages

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(chat_template=TOOL_TEMPLATE)


def _valid(call: Any) -> dict[str, Any]:
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, SCHEMAS[call.function.name])
    return args


def test_required_call_validates_streams_alike_and_round_trips(server: Any) -> None:
    client: openai.OpenAI = server.client()
    kw: dict[str, Any] = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                              parallel_tool_calls=False, max_tokens=120, temperature=1.0,
                              seed=11)
    done = client.chat.completions.create(**kw)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    _valid(call)
    # The stream, accumulated by the openai client's own helper, is the same call.
    with client.chat.completions.stream(**kw) as stream:
        events = [e for e in stream if e.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    streamed = final.message.tool_calls[0]
    assert (streamed.function.name, streamed.function.arguments) == \
        (call.function.name, call.function.arguments)
    # OpenAI's shape: the first delta of the call names it, later ones carry arguments.
    deltas = [tc for e in events for c in e.chunk.choices for tc in (c.delta.tool_calls or [])]
    assert deltas[0].id == streamed.id and deltas[0].function.name == call.function.name
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    # The tool's result goes back in the conversation, and the next turn is served.
    follow = client.chat.completions.create(
        model="tiny", max_tokens=8, temperature=0.0, tools=TOOLS, messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert follow.usage.prompt_tokens > done.usage.prompt_tokens
    server.wait_idle()
    assert server.leaked_pages() == 0


def test_named_choice_calls_that_function(server: Any) -> None:
    client = server.client()
    for seed in range(4):
        out = client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, max_tokens=120, temperature=1.0,
            seed=seed, tool_choice={"type": "function", "function": {"name": "add"}})
        calls = out.choices[0].message.tool_calls
        assert out.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in calls] == ["add"]
        _valid(calls[0])


def test_parallel_required_calls_are_each_valid(server: Any) -> None:
    out = server.client().chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=1.0, seed=5, n=4)
    for choice in out.choices:
        calls = choice.message.tool_calls
        assert calls, choice
        # A cut call (max_tokens) is the last one; every complete one validates.
        complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]
        for c in complete:
            _valid(c)
        assert len({c.id for c in calls}) == len(calls)


def test_tool_choice_none_leaves_tools_out_of_the_prompt(server: Any) -> None:
    client = server.client()
    kw: dict[str, Any] = dict(model="tiny", messages=ASK, max_tokens=4, temperature=0.0)
    plain = client.chat.completions.create(**kw)
    none = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="none")
    auto = client.chat.completions.create(**kw, tools=TOOLS)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_llama3_json_parser_server(make_server: Any) -> None:
    server = make_server(tool_call_parser="llama3_json", chat_template=TOOL_TEMPLATE)
    out = server.client().chat.completions.create(
        model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, temperature=1.0, seed=2)
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    _valid(call)


@pytest.mark.parametrize("body,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "frob"}}}}}]}, "tools"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
      "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
])
def test_bad_tool_requests_are_400s_naming_the_field(server: Any, body: dict,
                                                     param: str) -> None:
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


# ------------------------------------------------------------------------ the parsers
def _streamed(parser: str, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``text`` in random pieces; reassemble the deltas as an OpenAI client does."""
    p = ToolCallParser(parser)
    content, calls = "", {}
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(1, 6)
        pieces.append(text[i:i + k])
        i += k
    for delta in [p.feed(x) for x in pieces] + [p.finish()]:
        content += delta.content
        for tc in delta.tool_calls:
            c = calls.setdefault(tc["index"], ["", ""])
            if "id" in tc:
                assert tc["type"] == "function" and not c[0]
                c[0] = tc["function"]["name"]
            c[1] += tc["function"]["arguments"]
    return content, [tuple(c) for _, c in sorted(calls.items())]


@pytest.mark.parametrize("parser,text,content,calls", [
    ("hermes", 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, {"b": "}"}]}}\n'
     '</tool_call>\n<tool_call>\n{"arguments":{"x":"\\"q"},"name":"g"}\n</tool_call>',
     "Sure.\n", [("f", '{"a": [1, {"b": "}"}]}'), ("g", '{"x":"\\"q"}')]),
    ("hermes", "no call here: <tool and < x", "no call here: <tool and < x", []),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1', "", [("f", '{"a": 1')]),
    ("hermes", "<tool_call>\nnot json</tool_call> after",
     "<tool_call>\nnot json</tool_call> after", []),
    ("hermes", '<tool_call>{"name":"f"}</tool_call>', "", [("f", "{}")]),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}',
     "", [("f", '{"a": 1}'), ("g", "{}")]),
    ("llama3_json", 'Hello {"name": "f"}', 'Hello {"name": "f"}', []),
])
def test_parsers_whole_and_streamed(parser: str, text: str, content: str,
                                    calls: list[tuple[str, str]]) -> None:
    whole_content, whole_calls = ToolCallParser(parser).parse(text)
    assert whole_content == content
    assert [(c.name, c.arguments) for c in whole_calls] == calls
    rng = random.Random(0)
    for _ in range(25):
        assert _streamed(parser, text, rng) == (content, calls)


def test_unknown_parser_is_refused() -> None:
    from serving.cli import build_parser
    from serving.tools import TOOL_PARSERS

    with pytest.raises(ValueError):
        ToolCallParser("mistral")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--tool-call-parser", "mistral"])
    action = next(a for a in build_parser()._actions if a.dest == "tool_call_parser")
    assert tuple(action.choices) == TOOL_PARSERS


def test_templates_choose_how_tools_are_rendered() -> None:
    import tokenizers

    from conflux_jax.tokenizer import Tokenizer

    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    llama = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}"
             "<|start_header_id|>{{ m.role }}<|end_header_id|>{{ m.content }}<|eot_id|>"
             "{% endfor %}")
    native = Tokenizer(backend, chat_template=llama)
    plain = Tokenizer(backend)  # ChatML: no tools
    assert native.supports_tools and not plain.supports_tools
    assert default_parser(native.chat_template, True) == "llama3_json"
    assert default_parser(plain.chat_template, False) == "hermes"
    text = native.apply_chat_template(ASK, tools=TOOLS)
    assert text.startswith(json.dumps(TOOLS))
    # Without template support: Hermes instructions in the system prompt, earlier calls
    # and results spelled out in that format.
    convo = [*ASK, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21C"}]
    msgs = prompt_messages(convo, "hermes", False, TOOLS)
    assert msgs[0]["role"] == "system" and "<tools>" in msgs[0]["content"]
    assert json.dumps(WEATHER) in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", '
                       '"arguments": {"city": "Paris"}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n21C\n</tool_response>"}
    rendered = plain.apply_chat_template(msgs)
    assert "<|im_start|>system\n# Tools" in rendered


@pytest.mark.slow
def test_default_model_tool_round_trip() -> None:
    """SmolLM2-135M (its template knows no tools: the Hermes system prompt): a required
    call validates, streams to the same call, and its result is accepted back."""
    from serving_helpers import LiveServer

    from conflux_jax.checkpoints import load_checkpoint
    from conflux_jax.engine import Engine, EngineConfig
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig

    ckpt = load_checkpoint("default")
    assert not ckpt.tokenizer.supports_tools
    ec = ExecutorConfig(mesh="sp=1,tp=1", page_size=16, num_pages=96, max_model_len=768,
                        buckets=BucketConfig(tokens=(64, 256), decode=(2,),
                                             decode_pages=(48,), max_prefill_seqs=2))
    engine = Engine(ckpt.config, ckpt.params, ckpt.tokenizer, EngineConfig(executor=ec))
    server = LiveServer(engine, model_name="default")
    try:
        client = server.client(timeout=600)
        kw: dict[str, Any] = dict(model="default", messages=ASK, tools=[WEATHER],
                                  tool_choice="required", parallel_tool_calls=False,
                                  max_tokens=64, temperature=0.0)

        def streamed_call() -> Any:
            with client.chat.completions.stream(**kw) as stream:
                for _ in stream:
                    pass
                return stream.get_final_completion().choices[0].message.tool_calls[0]

        # The streamed request runs beside the whole one (one batch: half the decode steps).
        with ThreadPoolExecutor(1) as pool:
            streaming = pool.submit(streamed_call)
            done = client.chat.completions.create(**kw)
            streamed = streaming.result()
        assert done.choices[0].finish_reason == "tool_calls"
        call = done.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        _valid(call)
        assert (streamed.function.name, streamed.function.arguments) == \
            (call.function.name, call.function.arguments)
        follow = client.chat.completions.create(
            model="default", max_tokens=4, temperature=0.0, tools=[WEATHER], messages=[
                *ASK, {"role": "assistant", "content": None,
                       "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"celsius": 21}'}])
        assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")
        assert follow.usage.completion_tokens > 0
    finally:
        server.stop()
