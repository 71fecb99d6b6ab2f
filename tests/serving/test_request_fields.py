"""Every field of OpenAI's chat and completions request schemas, and vLLM's extras, sent
to the server: each has its effect or is a 400 that names it; unknown fields are 400s.

The field lists come from the installed ``openai`` package (its ``TypedDict`` request
params), so a field OpenAI adds fails ``test_every_openai_field_is_covered`` until it is
decided. Effects are checked against independent oracles: a baseline greedy answer, the
tokenizer, ``json``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from openai.types import completion_create_params as cmpl_params
from openai.types.chat import completion_create_params as chat_params
from serving_helpers import TOOL_TEMPLATE

MSG = [{"role": "user", "content": "Say something."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"],
    "additionalProperties": False}}}
Check = Callable[[Any, dict[str, Any]], None]  # (server, response body) -> assert


@pytest.fixture(scope="module")
def server(make_server: Any) -> Any:
    return make_server(chat_template=TOOL_TEMPLATE)  # room for tools in 256 tokens


def _post(server: Any, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json={"model": "tiny", **body}, timeout=60)


def _greedy(server: Any, route: str, **extra: Any) -> dict[str, Any]:
    base = {"messages": MSG} if route == "chat/completions" else {"prompt": "Once"}
    r = _post(server, route, {**base, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                              "return_token_ids": True, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _text(body: dict[str, Any], i: int = 0) -> str:
    c = body["choices"][i]
    return c["message"]["content"] if "message" in c else c["text"]


def _ok(_: Any, body: dict[str, Any]) -> None:  # a documented no-op: accepted
    assert body["choices"]


def _salted(server: Any, body: dict[str, Any]) -> None:
    """cache_salt: a prompt shares cached KV only with requests of the same salt."""
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    prompt = "Once upon a time there was a tiny model that liked tests. " * 4
    salt = f"tenant-{uuid.uuid4().hex}"

    def cached(salt: str) -> int:
        return _greedy(server, "completions", prompt=prompt, cache_salt=salt
                       )["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(salt) == 0  # a new tenant starts cold
    assert cached(salt) > 0  # its second request reuses its own prefix
    assert cached(salt + "-other") == 0  # another tenant's does not


def _same_as_greedy(route: str) -> Check:
    def check(server: Any, body: dict[str, Any]) -> None:
        assert _text(body) == _text(_greedy(server, route))
    return check


def _tokens_at_most(n: int) -> Check:
    def check(_: Any, body: dict[str, Any]) -> None:
        assert 1 <= body["usage"]["completion_tokens"] <= n
    return check


def _choices(n: int) -> Check:
    def check(_: Any, body: dict[str, Any]) -> None:
        assert [c["index"] for c in body["choices"]] == list(range(n))
    return check


def _only_token(route: str) -> Check:
    def check(server: Any, body: dict[str, Any]) -> None:
        tok = server.engine.tokenizer
        assert body["choices"][0]["token_ids"] == [tok.token_to_id("a")] * 8
    return check


def _chat_logprobs(top: int) -> Check:
    def check(_: Any, body: dict[str, Any]) -> None:
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == body["usage"]["completion_tokens"]
        assert all(len(e["top_logprobs"]) == top for e in content)
    return check


def _json_object(_: Any, body: dict[str, Any]) -> None:
    import json

    c = body["choices"][0]
    if c["finish_reason"] == "stop":
        assert isinstance(json.loads(_text(body)), dict)
    else:
        assert c["finish_reason"] == "length"


def _tool_call(_: Any, body: dict[str, Any]) -> None:
    calls = body["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["f"]


def _stopped_at_second_token(route: str) -> Check:
    def check(server: Any, body: dict[str, Any]) -> None:
        base = _greedy(server, route)["choices"][0]["token_ids"]
        assert body["choices"][0]["token_ids"] == base[:2]
        assert body["choices"][0]["finish_reason"] == "stop"
    return check


def _echoed(_: Any, body: dict[str, Any]) -> None:
    assert body["choices"][0]["text"].startswith("Once")


def _named(_: Any, body: dict[str, Any]) -> None:
    assert body["id"].endswith("-my-req-1")


# Shared by both routes: field -> (value, check) or (value, None) for "a 400 naming it".
# Some values need a context: those are callables of the route.
COMMON: dict[str, Any] = {
    "frequency_penalty": (2.0, _ok),  # effect: test_structured_outputs (numpy oracle)
    "presence_penalty": (2.0, _ok),
    "logit_bias": (lambda s: {str(s.engine.tokenizer.token_to_id("a")): 100}, "only_token"),
    "max_tokens": (3, _tokens_at_most(3)),
    "n": (2, _choices(2)),
    "seed": (3, _ok),  # reproducibility: test_structured_outputs
    "stop": (None, "stop"),
    "stream_options": ({"include_usage": True}, None),  # needs stream=true
    "temperature": (0.0, "greedy"),
    "top_p": (1e-9, "greedy_t1"),
    "user": ("u-1", _ok),
}
CHAT: dict[str, Any] = {
    **COMMON,
    "audio": ({"voice": "alloy", "format": "wav"}, None),
    "function_call": ("auto", None),
    "functions": ([{"name": "f"}], None),
    "logprobs": (True, _chat_logprobs(0)),
    "max_completion_tokens": (2, _tokens_at_most(2)),
    "metadata": ({"k": "v"}, _ok),
    "modalities": (["audio"], None),
    "moderation": ({}, None),
    "parallel_tool_calls": (False, "tools"),
    "prediction": ({"type": "content", "content": "x"}, None),
    "prompt_cache_key": ("k", _ok),
    "prompt_cache_options": ({}, None),
    "prompt_cache_retention": ("24h", None),
    "reasoning_effort": ("low", None),
    "response_format": ({"type": "json_object"}, _json_object),
    "safety_identifier": ("s", _ok),
    "service_tier": ("flex", None),
    "store": (True, None),
    "tool_choice": ("required", "tools"),
    "tools": ([TOOL], "tools"),
    "top_logprobs": (2, None),  # needs logprobs=true
    "verbosity": ("low", None),
    "web_search_options": ({}, None),
}
COMPLETIONS: dict[str, Any] = {
    **COMMON,
    "best_of": (2, None),  # other than n
    "echo": (True, _echoed),
    "logprobs": (2, "cmpl_logprobs"),
    "suffix": ("x", None),
}
VLLM: dict[str, Any] = {
    "top_k": (1, "greedy_t1"),
    "min_p": (1.0, "greedy_t1"),  # only the likeliest token is left: greedy
    "repetition_penalty": (1.5, _ok),  # effect: test_structured_outputs
    "length_penalty": (2.0, None),
    "stop_token_ids": (None, "stop_ids"),
    "include_stop_str_in_output": (True, _ok),  # with stop: test_serving_api
    "ignore_eos": (True, _ok),  # every other case here runs with it
    "min_tokens": (None, "min_tokens"),
    "skip_special_tokens": (False, _ok),
    "spaces_between_special_tokens": (False, None),
    "truncate_prompt_tokens": (2, "truncated"),
    "prompt_logprobs": (1, None),
    "allowed_token_ids": (lambda s: [s.engine.tokenizer.token_to_id("a")], "only_token"),
    "bad_words": (["x"], None),
    "use_beam_search": (True, None),
    "structured_outputs": ({"choice": ["yes", "no"]}, "yes_no"),
    "guided_choice": (["yes", "no"], "yes_no"),
    "guided_regex": ("(yes|no)", "yes_no"),
    "guided_json": ({"type": "object"}, _json_object),
    "guided_grammar": ('start: "yes" | "no"', "yes_no"),
    "guided_decoding_backend": ("xgrammar", None),
    "guided_whitespace_pattern": (" ", None),
    "priority": (1, None),
    "request_id": ("my-req-1", _named),
    "logits_processors": (["x"], None),
    "return_tokens_as_token_ids": (True, None),
    "return_token_ids": (True, "token_ids"),
    "cache_salt": ("s", _salted),
    "kv_transfer_params": ({}, None),
    "vllm_xargs": ({"a": 1}, None),
    "ttft_slo_ms": (5000.0, _ok),  # ours: the scheduler's SLO (test_serving_api)
    "tbt_slo_ms": (5000.0, _ok),
}
CHAT_VLLM: dict[str, Any] = {
    "add_generation_prompt": (False, _ok),
    "continue_final_message": (True, "continue"),
    "add_special_tokens": (True, _ok),
    "documents": ([{"title": "t", "text": "x"}], _ok),
    "chat_template": ("{{ messages }}", None),
    "chat_template_kwargs": ({"enable_thinking": False}, _ok),
    "mm_processor_kwargs": ({}, None),
    "echo": (True, None),
}


def _case(server: Any, route: str, field: str, spec: tuple[Any, Any]
          ) -> tuple[dict[str, Any], Check | None]:
    """The request body that sends ``field`` and the check of its effect (None: a 400)."""
    value, check = spec
    if callable(value):
        value = value(server)
    body: dict[str, Any] = {field: value}
    if check == "only_token":
        check = _only_token(route)
    elif check == "greedy":
        check = _same_as_greedy(route)
    elif check == "greedy_t1":
        body["temperature"] = 1.0
        check = _same_as_greedy(route)
    elif check == "stop":
        text = _text(_greedy(server, route))
        # A printable ASCII character of the greedy answer (not its first): the answer
        # with it as a stop string is the text before it.
        stop = next((c for c in text[1:] if c.isascii() and c.isprintable()), None)
        if stop is None:
            pytest.skip("the greedy answer has no ASCII character to stop at")
        body["stop"] = [stop]

        def check(_: Any, b: dict[str, Any], text: str = text, stop: str = stop) -> None:
            assert _text(b) == text[:text.index(stop)]
    elif check == "stop_ids":
        base = _greedy(server, route)["choices"][0]["token_ids"]
        body.update(stop_token_ids=[base[1]], ignore_eos=False)
        if base[0] == base[1]:
            pytest.skip("the greedy answer repeats its first token")
        check = _stopped_at_second_token(route)
    elif check == "min_tokens":
        # The second greedy token stops it, unless min_tokens holds the stop back.
        base = _greedy(server, route)["choices"][0]["token_ids"]
        body.update(stop_token_ids=[base[1]], ignore_eos=False, min_tokens=5, max_tokens=6)

        def check(_: Any, b: dict[str, Any], stop: int = base[1]) -> None:
            ids = b["choices"][0]["token_ids"]
            assert len(ids) >= 5 and stop not in ids[:5]
    elif check == "tools":
        body.update(tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                    max_tokens=60, temperature=1.0)
        check = _tool_call
    elif check == "yes_no":
        def check(_: Any, b: dict[str, Any]) -> None:
            assert _text(b) in ("yes", "no")
    elif check == "cmpl_logprobs":
        def check(_: Any, b: dict[str, Any]) -> None:
            lp = b["choices"][0]["logprobs"]
            assert len(lp["tokens"]) == b["usage"]["completion_tokens"]
            assert all(len(t) <= 2 for t in lp["top_logprobs"])
    elif check == "truncated":
        def check(_: Any, b: dict[str, Any]) -> None:
            assert b["usage"]["prompt_tokens"] == 2
    elif check == "token_ids":
        def check(_: Any, b: dict[str, Any]) -> None:
            assert len(b["choices"][0]["token_ids"]) == b["usage"]["completion_tokens"]
            assert len(b["prompt_token_ids"]) == b["usage"]["prompt_tokens"]
    elif check == "continue":
        body.update(add_generation_prompt=False, messages=[
            *MSG, {"role": "assistant", "content": "Well"}])

        def check(server: Any, b: dict[str, Any]) -> None:
            plain = _greedy(server, "chat/completions",
                            messages=[*MSG, {"role": "assistant", "content": "Well"}],
                            add_generation_prompt=False)
            # Continuing leaves the final turn open: the prompt stops before its end.
            assert b["usage"]["prompt_tokens"] < plain["usage"]["prompt_tokens"]
    return body, check


def _run(server: Any, route: str, field: str, spec: tuple[Any, Any]) -> None:
    extra, check = _case(server, route, field, spec)
    base = {"messages": MSG} if route == "chat/completions" else {"prompt": "Once"}
    r = _post(server, route, {**base, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                              "return_token_ids": True, **extra})
    if check is None:
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == field, err
        assert field in err["message"], err
    else:
        assert r.status_code == 200, r.text
        check(server, r.json())


@pytest.mark.parametrize("field", sorted(CHAT) + sorted(f"vllm:{f}" for f in {**VLLM,
                                                                             **CHAT_VLLM}))
def test_chat_field(server: Any, field: str) -> None:
    name = field.removeprefix("vllm:")
    spec = {**CHAT, **VLLM, **CHAT_VLLM}[name]
    _run(server, "chat/completions", name, spec)


@pytest.mark.parametrize("field", sorted(COMPLETIONS) + sorted(f"vllm:{f}" for f in VLLM))
def test_completions_field(server: Any, field: str) -> None:
    name = field.removeprefix("vllm:")
    _run(server, "completions", name, {**COMPLETIONS, **VLLM}[name])


def test_every_openai_field_is_covered() -> None:
    required = {"model", "messages", "prompt", "stream"}  # sent by every case
    chat = set(chat_params.CompletionCreateParamsBase.__annotations__) - required
    cmpl = set(cmpl_params.CompletionCreateParamsBase.__annotations__) - required
    assert chat <= set(CHAT), sorted(chat - set(CHAT))
    assert cmpl <= set(COMPLETIONS), sorted(cmpl - set(COMPLETIONS))


@pytest.mark.parametrize("route,body,param", [
    ("chat/completions", {"messages": MSG, "frobnicate": 1}, "frobnicate"),
    ("completions", {"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x", "audio": {}}]},
     "messages"),
    ("chat/completions", {"messages": MSG, "stream_options": {"include_usage": True,
                                                              "x": 1}}, "stream_options"),
    ("completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
    ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"a": 100}}, "logit_bias"),
])
def test_unknown_and_unsupported_values_name_their_field(server: Any, route: str,
                                                         body: dict, param: str) -> None:
    r = _post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    if param == "frobnicate":
        assert "unknown field 'frobnicate'" in err["message"]


def test_streamed_echo_and_min_tokens(server: Any) -> None:
    """echo leads the stream with the prompt; min_tokens holds in a stream too."""
    import json

    events = []
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Once", "max_tokens": 5, "temperature": 0,
            "echo": True, "stream": True, "ignore_eos": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    whole = _post(server, "completions", {"prompt": "Once", "max_tokens": 5,
                                          "temperature": 0, "echo": True,
                                          "ignore_eos": True}).json()
    assert events[0]["choices"][0]["text"] == "Once"
    assert text == whole["choices"][0]["text"]


# ------------------------------------------------------------- vLLM's small endpoints
def test_tokenize_detokenize_version(server: Any) -> None:
    tok = server.engine.tokenizer
    r = httpx.post(server.url + "/tokenize", timeout=30, json={
        "model": "tiny", "prompt": "Once upon a time", "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = tok.encode("Once upon a time", add_special_tokens=True)
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == server.engine.max_model_len
    assert "".join(body["token_strs"]) == tok.decode(ids, skip_special_tokens=False)
    # Messages tokenize to the very prompt the chat route runs.
    chat = _greedy(server, "chat/completions", max_tokens=2)
    r = httpx.post(server.url + "/tokenize", timeout=30, json={"messages": MSG})
    assert r.json()["tokens"] == chat["prompt_token_ids"]
    assert r.json()["token_strs"] is None
    r = httpx.post(server.url + "/detokenize", timeout=30, json={"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(ids)}
    r = httpx.get(server.url + "/version", timeout=30)
    assert r.status_code == 200 and isinstance(r.json()["version"], str)


@pytest.mark.parametrize("route,body,status,param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"prompt": "x", "frob": 1}, 400, None),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
])
def test_small_endpoint_errors(server: Any, route: str, body: dict, status: int,
                               param: str | None) -> None:
    r = httpx.post(server.url + route, json=body, timeout=30)
    assert r.status_code == status, r.text
    if param is not None:
        assert r.json()["error"]["param"] == param
