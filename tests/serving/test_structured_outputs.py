"""Structured outputs, n > 1 and the penalties through the real ``openai`` client.

The tiny model is random, so any valid output is the token mask's doing. Oracles:
``jsonschema`` over the schema the client sent, ``re.fullmatch`` for regexes, set
membership for choices.
"""

from __future__ import annotations

import enum
import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Any, Literal

import jsonschema
import openai
import pytest
from openai.lib._pydantic import to_strict_json_schema
from pydantic import BaseModel, Field

Short = Annotated[str, Field(max_length=8)]


class Person(BaseModel):
    name: Short
    age: Annotated[int, Field(ge=0, le=120)]


class Color(BaseModel):
    color: Literal["red", "green", "blue"]


class Address(BaseModel):
    city: Short
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]


class User(BaseModel):
    name: Short
    address: Address


class Tags(BaseModel):
    tags: Annotated[list[Literal["a", "b", "c"]], Field(min_length=1, max_length=4)]


class Measurement(BaseModel):
    value: Annotated[float, Field(ge=-1.5, le=2.5)]
    count: Annotated[int, Field(ge=1, le=9)]


class Flags(BaseModel):
    ok: bool
    note: Short | None


class Item(BaseModel):
    sku: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]
    qty: Annotated[int, Field(ge=1, le=5)]


class Order(BaseModel):
    items: Annotated[list[Item], Field(min_length=1, max_length=3)]


class Company(BaseModel):
    ceo: Person
    hq: Address


class Status(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class Ticket(BaseModel):
    status: Status
    priority: Annotated[int, Field(ge=1, le=3)]


class Point(BaseModel):
    x: Annotated[int, Field(ge=-10, le=10)]
    y: Annotated[int, Field(ge=-10, le=10)]
    label: Literal["p", "q"]


MODELS = [Person, Color, User, Tags, Measurement, Flags, Order, Company, Ticket, Point]
MESSAGES = [{"role": "user", "content": "Reply in JSON."}]


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server()


def _parse(client: openai.OpenAI, model: type[BaseModel], seed: int) -> Any:
    done = client.chat.completions.parse(model="tiny", messages=MESSAGES, response_format=model,
                                         max_tokens=200, temperature=1.0, seed=seed)
    return done.choices[0]


def _stream(client: openai.OpenAI, model: type[BaseModel], seed: int) -> Any:
    with client.chat.completions.stream(model="tiny", messages=MESSAGES, response_format=model,
                                        max_tokens=200, temperature=1.0, seed=seed) as s:
        for _ in s:
            pass
        return s.get_final_completion().choices[0]


@pytest.mark.parametrize("how", [_parse, _stream], ids=["whole", "streamed"])
def test_parse_returns_schema_valid_objects(server: Any, how: Any) -> None:
    client = server.client()
    with ThreadPoolExecutor(8) as pool:  # concurrent: constrained rows share steps
        choices = list(pool.map(lambda m: how(client, m, MODELS.index(m)), MODELS))
    for model, choice in zip(MODELS, choices, strict=True):
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)
        schema = to_strict_json_schema(model)
        jsonschema.validate(json.loads(choice.message.content), schema)
    server.wait_idle()
    assert server.leaked_pages() == 0


def test_json_object_and_vllm_structured_outputs_json(server: Any) -> None:
    client = server.client()
    obj = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=200,
                                         temperature=1.0, seed=3,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].message.content), dict)
    else:  # an unbounded object may run out of tokens: then it says so
        assert obj.choices[0].finish_reason == "length"
    schema = {"type": "object", "properties": {"k": {"enum": [1, 2, 3]}}, "required": ["k"],
              "additionalProperties": False}
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                  {"guided_json": json.dumps(schema)}):
        out = client.completions.create(model="tiny", prompt="x", max_tokens=20,
                                        temperature=1.0, extra_body=extra)
        jsonschema.validate(json.loads(out.choices[0].text), schema)
        assert out.choices[0].finish_reason == "stop"


def test_truncated_json_says_length(server: Any) -> None:
    out = server.client().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=3, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {
            "name": "p", "schema": to_strict_json_schema(Company), "strict": True}})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 3


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"regex": r"[a-c]{2,4}-[0-9]{2}"}},
     lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t)),
    ({"guided_regex": r"(yes|no)![0-9]"}, lambda t: re.fullmatch(r"(yes|no)![0-9]", t)),
    ({"structured_outputs": {"choice": ["alpha", "beta", "gamma delta"]}},
     lambda t: t in {"alpha", "beta", "gamma delta"}),
    ({"guided_choice": ["up", "down"]}, lambda t: t in {"up", "down"}),
    ({"structured_outputs": {"grammar": 'start: "<" ("x" | "y")+ ">"'}},
     lambda t: re.fullmatch(r"<[xy]+>", t)),
], ids=["regex", "guided_regex", "choice", "guided_choice", "lark"])
def test_regex_choice_grammar_hold_on_100_samples(server: Any, extra: dict, check: Any) -> None:
    client = server.client()

    def batch(seed: int) -> list[Any]:  # n=10 choices, each an independent sequence
        out = client.completions.create(model="tiny", prompt="Answer:", max_tokens=40,
                                        temperature=1.0, n=10, seed=seed, extra_body=extra)
        return out.choices

    with ThreadPoolExecutor(4) as pool:
        choices = [c for cs in pool.map(batch, range(10)) for c in cs]
    assert len(choices) == 100
    for c in choices:
        assert c.finish_reason == "stop" and check(c.text), c.text
    assert len({c.text for c in choices}) > 1  # temperature 1 does sample


def test_stop_string_cuts_a_constrained_output(server: Any) -> None:
    out = server.client().completions.create(
        model="tiny", prompt="x", max_tokens=30, temperature=1.0, seed=1, stop=["-"],
        extra_body={"guided_regex": r"ab-[0-9]{3}"})
    assert out.choices[0].text == "ab" and out.choices[0].finish_reason == "stop"


def test_n_choices_are_independent_and_seeded(server: Any) -> None:
    client = server.client()
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=12, temperature=1.0, seed=7, n=4)
    a = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1, 2, 3]
    texts = [c.message.content for c in a.choices]
    assert len(set(texts)) > 1
    assert 4 <= a.usage.completion_tokens <= 4 * 12  # summed over the choices
    # The same request again is the same choices (choice i samples with seed + i) ...
    b = client.chat.completions.create(**kw)
    assert [c.message.content for c in b.choices] == texts
    # ... and so is the stream, whose chunks carry each choice's index.
    parts: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}):
        for c in chunk.choices:
            parts[c.index] = parts.get(c.index, "") + (c.delta.content or "")
        usage = chunk.usage or usage
    assert [parts[i] for i in range(4)] == texts
    assert usage.completion_tokens == a.usage.completion_tokens
    assert usage.prompt_tokens == a.usage.prompt_tokens  # the prompt counts once
    server.wait_idle()
    assert server.leaked_pages() == 0


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frob"}}}}}},
     "structured_outputs"),
    ({"guided_regex": "(unclosed"}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"n": 0}, "n"), ({"n": 17}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_constraints_and_penalties_are_400s_naming_the_field(server: Any, body: dict,
                                                                  param: str) -> None:
    import httpx

    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "model": "tiny", "messages": MESSAGES, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_penalties_change_greedy_output(server: Any) -> None:
    client = server.client()
    kw = dict(model="tiny", prompt="a a a a", max_tokens=24, temperature=0.0)
    free = client.completions.create(**kw).choices[0].text
    rep = client.completions.create(**kw, extra_body={"repetition_penalty": 2.0}).choices[0]
    freq = client.completions.create(**kw, frequency_penalty=2.0).choices[0]
    assert rep.text != free or freq.text != free


def test_offline_llm_takes_vllms_structured_output_params(tiny_checkpoint: Any) -> None:
    from conflux_jax import LLM, GuidedDecodingParams, SamplingParams, StructuredOutputsParams

    llm = LLM(str(tiny_checkpoint), max_model_len=128)
    schema = to_strict_json_schema(Point)
    outs = llm.generate(["a", "b"], [
        SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=3,
                       guided_decoding=GuidedDecodingParams(choice=["yes", "no"])),
        SamplingParams(max_tokens=60, temperature=1.0, seed=6,
                       structured_outputs=StructuredOutputsParams(json=schema))])
    assert [c.index for c in outs[0].outputs] == [0, 1, 2]
    assert all(c.text in {"yes", "no"} and c.finish_reason == "stop" for c in outs[0].outputs)
    jsonschema.validate(json.loads(outs[1].outputs[0].text), schema)
