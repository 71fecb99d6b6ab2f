"""Bounded fuzzing of the OpenAPI schema with hypothesis: bodies are generated from the
app's own /openapi.json (so new fields are fuzzed as they appear), mixing plausible values,
out-of-range values, wrong types and raw garbage. Whatever comes in: never a 5xx, every
error is OpenAI-shaped, every 200 is a well-formed answer, and nothing leaks."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MAX_EXAMPLES = 120
STATUS: list[int] = []

# Any code point, and lone surrogates often: JSON's "\ud800" escape decodes to one, which
# is not text a tokenizer can take.
any_text = st.one_of(
    st.text(max_size=12), st.text(st.characters(exclude_categories=()), max_size=12),
    st.builds(str.__add__, st.text(max_size=6),
              st.text(st.characters(categories=["Cs"]), min_size=1, max_size=2)))
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                         st.floats(allow_nan=False, allow_infinity=False), any_text)
any_json = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10)
# The same shapes with well-formed text only: what the plausible (non-hostile) bodies use.
plausible_json = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-3, 12), st.floats(0.05, 1.0),
              st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=10)


def _integers(schema: dict[str, Any], hostile: bool) -> st.SearchStrategy[int]:
    # Valid values stay small (bounded generation time); out-of-range ones are invalid.
    lo, hi = schema.get("minimum"), schema.get("maximum")
    small = st.integers(max(-3, int(lo if lo is not None else -3)),
                        min(12, int(hi if hi is not None else 12)))
    if not hostile:
        return small
    edges = [2**70, -(2**70)] + [int(b) + d for b, d in ((lo, -1), (hi, 1)) if b is not None]
    return st.one_of(st.integers(-3, 12), st.sampled_from(edges))


def from_schema(schema: dict[str, Any], spec: dict[str, Any], depth: int = 0,
                hostile: bool = True) -> st.SearchStrategy[Any]:
    """Values for ``schema``. ``hostile``: wrong-typed JSON and out-of-range numbers mixed
    in at every node; otherwise plausible values and a few optional fields per object."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return from_schema(spec["components"]["schemas"][name], spec, depth, hostile)
    if "anyOf" in schema:
        plausible = st.one_of(*[from_schema(s, spec, depth, hostile) for s in schema["anyOf"]])
    elif "enum" in schema or "const" in schema:
        plausible = st.sampled_from(schema.get("enum") or [schema["const"]])
    else:
        t = schema.get("type")
        if t == "string":  # plausible text is well-formed (lone surrogates are hostile)
            plausible = any_text if hostile else st.text(min_size=1, max_size=12)
        elif t == "integer":
            plausible = _integers(schema, hostile)
        elif t == "number":
            plausible = st.one_of(st.floats(-2, 3, allow_nan=False), st.sampled_from(
                [0.0, 1.0, -1e308, 1e308])) if hostile else st.floats(0.05, 1.0)
        elif t == "boolean":
            plausible = st.booleans()
        elif t == "null":
            plausible = st.none()
        elif t == "array":
            plausible = st.lists(from_schema(schema.get("items", {}), spec, depth + 1, hostile),
                                 min_size=0 if hostile else 1, max_size=3 if depth else 5)
        elif t == "object" and "properties" in schema and depth < 3:
            plausible = _objects(schema, spec, depth + 1, hostile)
        else:
            plausible = any_json if hostile else plausible_json
    return st.one_of(plausible, plausible, plausible, any_json) if hostile else plausible


def _objects(schema: dict[str, Any], spec: dict[str, Any], depth: int, hostile: bool
             ) -> st.SearchStrategy[dict[str, Any]]:
    props = schema["properties"]
    required = {k: from_schema(v, spec, depth, hostile) for k, v in props.items()
                if k in schema.get("required", ())}
    optional = {k: from_schema(v, spec, depth, hostile) for k, v in props.items()
                if k not in required}
    if hostile or not optional:
        return st.fixed_dictionaries(required, optional=optional)
    # Plausible bodies set only a few optional fields, so many of them are valid.
    return st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({**required, **{k: optional[k] for k in keys}}))


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


@pytest.fixture(scope="module")
def bodies(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    out = {}
    for path, item in spec["paths"].items():
        post = item.get("post")
        if post and "requestBody" in post:
            schema = post["requestBody"]["content"]["application/json"]["schema"]
            out[path] = (from_schema(schema, spec, hostile=True),
                         from_schema(schema, spec, hostile=False))
    assert set(out) == set(POST_ENDPOINTS)
    return out


POST_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


def _check(r: httpx.Response, body: Any, path: str) -> None:
    assert r.status_code < 500, (r.status_code, r.text, body)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
    elif path == "/tokenize":
        got = r.json()
        assert got["count"] == len(got["tokens"]), got
    elif path == "/detokenize":
        assert isinstance(r.json()["prompt"], str)
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
    else:
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_fuzz_request_bodies(server, bodies):
    # The generation endpoints drawn most: they are the ones that reach the engine.
    paths = [p for p in sorted(bodies) for _ in range(3 if p.startswith("/v1/") else 1)]

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def one(data):
        path = data.draw(st.sampled_from(paths))
        # Well-typed bodies twice as often as hostile ones: enough must get past the
        # validator for the fuzzer to exercise the engine too.
        body = data.draw(bodies[path][min(1, data.draw(st.integers(0, 2)))])
        if isinstance(body, dict):
            # Mostly the served model and a short generation: reach the engine, quickly.
            if data.draw(st.integers(0, 9)) < 8:
                body["model"] = "tiny"
            if data.draw(st.integers(0, 9)) < 9:
                body["max_tokens"] = data.draw(st.integers(1, 6))
            body.pop("max_completion_tokens", None)
        r = httpx.post(server.url + path, content=json.dumps(body), timeout=60,
                       headers={"Content-Type": "application/json"})
        _check(r, body, path)
        STATUS.append(r.status_code)

    one()
    # The fuzzer must reach the engine, not only the validator.
    assert STATUS.count(200) >= MAX_EXAMPLES // 10, STATUS
    server.wait_idle()
    assert server.leaked_pages() == 0


@settings(max_examples=40, deadline=None, database=None, derandomize=True)
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)))
def test_fuzz_raw_bodies(server, raw):
    for path in POST_ENDPOINTS:
        r = httpx.post(server.url + path, content=raw, timeout=30,
                       headers={"Content-Type": "application/json"})
        assert 400 <= r.status_code < 500, (r.status_code, r.text, raw)
        assert r.json()["error"]["message"]
