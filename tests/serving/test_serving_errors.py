"""Every error the issue lists: status code + OpenAI-shaped message; aborts free pages;
a failing step fails its requests and the server keeps serving."""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import openai
import pytest
from fastapi.testclient import TestClient

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(make_server):
    return make_server(api_key=KEY, max_body_bytes=64 * 1024)


def _post(server, path, body=None, *, content=None, headers=AUTH, timeout=60):
    return httpx.post(server.url + path, json=body, content=content, headers=headers,
                      timeout=timeout)


def _error(r, status, *needles):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and isinstance(err["type"], str)
    for needle in needles:
        assert needle.lower() in err["message"].lower(), err["message"]
    return err


def _completion(**kw):
    return {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, **kw}


def test_malformed_json_is_400(server):
    r = _post(server, "/v1/completions", content=b'{"model": "tiny", "prompt": ',
              headers={**AUTH, "Content-Type": "application/json"})
    _error(r, 400, "JSON")


@pytest.mark.parametrize("patch, needle", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 17}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "batched"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": ["x"] * 40}, "stop"),
])
def test_bad_fields_are_400(server, patch, needle):
    _error(_post(server, "/v1/completions", _completion(**patch)), 400, needle)


@pytest.mark.parametrize("path, body, needle", [
    ("/v1/completions", _completion(prompt="\ud800"), "prompt"),
    ("/v1/completions", _completion(prompt="ok", stop=["a\udfff"]), "stop"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": "\udfff"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a\ud800"}]}]},
     "messages.0.content.0.text"),
])
def test_ill_formed_unicode_is_400_naming_the_field(server, path, body, needle):
    # json.dumps escapes the lone surrogate as \ud800: valid JSON, ill-formed text.
    r = _post(server, path, content=json.dumps(body).encode(),
              headers={**AUTH, "Content-Type": "application/json"})
    _error(r, 400, needle, "surrogate")


@pytest.mark.parametrize("field", ["stream", "ignore_eos", "echo"])
def test_booleans_are_strict(server, field):
    _error(_post(server, "/v1/completions", _completion(**{field: "yes"})), 400, field)


def test_an_empty_body_says_the_body_is_required(server):
    r = _post(server, "/v1/completions", content=b"",
              headers={**AUTH, "Content-Type": "application/json"})
    _error(r, 400, "request body is required")


def test_missing_field_is_400(server):
    err = _error(_post(server, "/v1/chat/completions", {"model": "tiny"}), 400, "messages")
    assert err["param"] == "messages"


def test_more_logprobs_than_the_server_computes_is_400(server):
    _error(_post(server, "/v1/completions", _completion(logprobs=8)), 400, "--max-logprobs")


def test_prompt_longer_than_context_is_400(server):
    ids = [5] * (server.engine.max_model_len + 10)
    _error(_post(server, "/v1/completions", _completion(prompt=ids)), 400, "context")
    long_text = "The quick brown fox jumps over the lazy dog. " * 60
    _error(_post(server, "/v1/chat/completions", {
        "model": "tiny", "messages": [{"role": "user", "content": long_text}]}), 400, "tokens")


def test_out_of_vocab_token_is_400(server):
    _error(_post(server, "/v1/completions", _completion(prompt=[1, 10**6])), 400, "token")


def test_unknown_model_is_404(server):
    err = _error(_post(server, "/v1/completions", _completion(model="gpt-9")), 404, "gpt-9")
    assert err["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        server.client(api_key=KEY).completions.create(model="nope", prompt="x", max_tokens=1)


def test_unknown_route_is_404_json(server):
    _error(httpx.get(server.url + "/v1/nothing", headers=AUTH), 404)


def test_missing_or_bad_key_is_401(server):
    _error(_post(server, "/v1/completions", _completion(), headers={}), 401, "missing")
    _error(_post(server, "/v1/completions", _completion(),
                 headers={"Authorization": "Bearer wrong"}), 401, "invalid")
    _error(_post(server, "/v1/completions", _completion(),
                 headers={"Authorization": f"Basic {KEY}"}), 401)
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    # Probes and scrapers need no key; the key works through the openai client.
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert server.client(api_key=KEY).models.list().data[0].id == "tiny"


def test_body_over_limit_is_413(server):
    big = _completion(prompt="x" * (70 * 1024))
    _error(_post(server, "/v1/completions", big), 413, "limit")

    def chunks():  # no Content-Length: counted while it streams in
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    r = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                   headers={**AUTH, "Content-Type": "application/json"})
    _error(r, 413, "limit")


def test_queue_full_is_429_with_retry_after(server):
    state = server.state
    original = state.settings
    state.settings = dataclasses.replace(original, max_queue=2)
    client = server.client(api_key=KEY)
    streams = []
    try:
        for _ in range(2):  # two long streams hold the two slots
            s = client.completions.create(model="tiny", prompt="hello", max_tokens=200,
                                          stream=True, extra_body={"ignore_eos": True})
            next(iter(s))
            streams.append(s)
        r = _post(server, "/v1/completions", _completion())
        _error(r, 429, "capacity")
        assert int(r.headers["Retry-After"]) >= 1
    finally:
        for s in streams:
            s.close()
        state.settings = original
    server.wait_idle()
    assert server.leaked_pages() == 0


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    server.wait_idle()
    body = _completion(max_tokens=200, stream=True, ignore_eos=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.engine.num_unfinished == 1
        assert server.leaked_pages() > 0
    # Leaving the block closes the connection mid-stream.
    server.wait_idle(timeout=10)
    assert server.leaked_pages() == 0
    metrics = httpx.get(server.url + "/metrics").text
    assert 'vllm:request_success_total{finished_reason="abort",model_name="tiny"}' in metrics
    # The gauges say so too, though no step ran after the abort.
    gauges = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
              for line in metrics.splitlines() if line and not line.startswith("#")
              and line.split("{")[0] in ("vllm:num_requests_running",
                                         "vllm:kv_cache_usage_perc", "conflux:kv_pages_used")}
    assert gauges == {"vllm:num_requests_running": 0.0, "vllm:kv_cache_usage_perc": 0.0,
                      "conflux:kv_pages_used": 0.0}, gauges


def test_non_streaming_client_disconnect_aborts(server):
    server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        _post(server, "/v1/completions", _completion(max_tokens=250, ignore_eos=True),
              timeout=0.3)
    server.wait_idle(timeout=10)
    assert server.leaked_pages() == 0


def test_exception_inside_a_step_fails_its_requests_and_serving_continues(server):
    """Fault injection at the executor boundary: the next ``launch`` raises once."""
    server.wait_idle()
    executor = server.engine.executor
    real_run = executor.launch  # how the engine starts each plan
    armed = threading.Event()

    def failing_once(plan, prepare=None, after=None):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("injected device failure")
        return real_run(plan, prepare, after)

    executor.launch = failing_once
    try:
        client = server.client(api_key=KEY)
        stream = client.completions.create(model="tiny", prompt="hello", max_tokens=100,
                                           stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        next(it)
        armed.set()
        with pytest.raises(openai.APIError) as info:
            for _ in it:
                pass
        assert "engine failed" in str(info.value)
        # Non-streaming: a 500 with the same message.
        armed.set()
        r = _post(server, "/v1/completions", _completion(max_tokens=50, ignore_eos=True))
        _error(r, 500, "engine failed")
        # The server keeps serving, and nothing leaked.
        out = client.completions.create(model="tiny", prompt="hello", max_tokens=5,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 5
    finally:
        executor.launch = real_run
    server.wait_idle()
    assert server.leaked_pages() == 0


def test_health_is_503_until_warm(tiny_engine):
    """A loop that has not finished warm-up: /health and the routes answer 503."""
    from serving.app import create_app
    from serving.engine_loop import EngineLoop
    from serving.settings import ServerSettings

    loop = EngineLoop(tiny_engine)  # never started: never ready
    app = create_app(loop, ServerSettings(model_name="tiny", max_model_len=256,
                                          stop_loop_on_shutdown=False))
    with TestClient(app) as c:
        _error(c.get("/health"), 503)
        _error(c.post("/v1/completions", json=_completion()), 503, "warming up")


def test_client_gone_before_the_first_chunk_is_cleaned_up(server):
    """Send a streaming request on a raw socket and hang up at once, many times."""
    import socket

    server.wait_idle()
    body = json.dumps(_completion(max_tokens=200, stream=True, ignore_eos=True)).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    for _ in range(10):
        with socket.create_connection(("127.0.0.1", server.port)) as s:
            s.sendall(head + body)
    server.wait_idle(timeout=30)  # also waits for the HTTP side's in-flight count
    assert server.leaked_pages() == 0


def _raw_exchange(server, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One raw HTTP/1.1 exchange; the server closes the connection after a parse error."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in header_lines)}
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize("framing", [
    b"Content-Length: twelve\r\n",  # not a number
    b"Content-Length: -5\r\n",  # negative
    b"Content-Length: 4\r\nContent-Length: 9\r\n",  # two that disagree
    b"Transfer-Encoding: chunked\r\n",  # and a body that is not chunked
    b"Bad Header Line\r\n",  # no colon
])
def test_malformed_http_framing_is_a_json_400(server, framing):
    status, headers, body = _raw_exchange(
        server, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + framing
        + f"Authorization: Bearer {KEY}\r\n".encode()
        + b"Content-Type: application/json\r\n\r\n{}\r\n")
    assert status == 400
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    err = json.loads(body)["error"]
    assert err["code"] == 400 and "content-length" in err["message"].lower()
    # The server is unharmed: the next request on a new connection is served.
    assert _post(server, "/v1/completions", _completion()).status_code == 200
