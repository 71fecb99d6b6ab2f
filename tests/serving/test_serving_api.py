"""The OpenAI routes against a live server with the real ``openai`` client (tiny model)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def server(make_server):
    return make_server()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _greedy(client, prompt=PROMPT, max_tokens=12, **kw):
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, **kw)


def test_models_and_health(server, client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["tiny"]
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_greedy_completion_matches_offline_llm(server, client, tiny_checkpoint):
    from conflux_jax import LLM, SamplingParams

    out = _greedy(client, max_tokens=16, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.completion_tokens == 16
    prompt_ids = server.engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    assert out.usage.prompt_tokens == len(prompt_ids)
    offline = LLM(str(tiny_checkpoint)).generate(
        [PROMPT], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].outputs[0]
    assert choice.text == offline.text


def test_streaming_equals_non_streaming(client):
    full = _greedy(client, max_tokens=10, extra_body={"ignore_eos": True})
    chunks = list(_greedy(client, max_tokens=10, stream=True,
                          stream_options={"include_usage": True},
                          extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_token_id_prompt(server, client):
    ids = server.engine.tokenizer.encode(PROMPT, add_special_tokens=True)
    a = _greedy(client, prompt=ids, max_tokens=6)
    b = _greedy(client, max_tokens=6)
    assert a.choices[0].text == b.choices[0].text


def test_chat_non_stream_and_stream(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "def add(a, b):"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
    msg = full.choices[0].message
    assert msg.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 8
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == msg.content


def test_stop_string(client):
    full = _greedy(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].text
    # Stop at the first ASCII letter or digit the model produced after the first char.
    at = next((i for i, ch in enumerate(full) if i > 0 and ch.isascii() and ch.isalnum()), None)
    if at is None:
        pytest.skip("the tiny model produced no ASCII text to stop on")
    stop = full[at]
    first = full.index(stop)
    out = _greedy(client, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:first]
    streamed = "".join(c.choices[0].text for c in _greedy(
        client, max_tokens=24, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == full[:first]


def test_seeded_sampling_is_reproducible(client):
    def sample(seed):
        return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                         temperature=1.0, top_p=0.95, seed=seed,
                                         extra_body={"top_k": 50, "ignore_eos": True}
                                         ).choices[0].text

    a, b, c = sample(1234), sample(1234), sample(99)
    assert a == b
    assert a != c


def test_logprobs(client):
    out = _greedy(client, max_tokens=4, logprobs=3, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    # A dict keyed by token text: distinct ids that decode alike (partial UTF-8) collide.
    assert all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    pairs = zip(lp.top_logprobs, lp.token_logprobs, strict=True)
    assert all(abs(max(t.values()) - v) < 1e-4 for t, v in pairs)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_per_request_slo_extension_reaches_the_scheduler(server, client):
    scheduler = server.engine.scheduler
    real_add, seen = scheduler.add, []

    def spy(request):  # observe what the scheduler is given; it still does the work
        seen.append(request)
        return real_add(request)

    scheduler.add = spy
    try:
        out = _greedy(client, max_tokens=3, extra_body={"ttft_slo_ms": 5000,
                                                        "tbt_slo_ms": 500})
        _greedy(client, max_tokens=3)
    finally:
        del scheduler.add
    assert out.choices[0].finish_reason in ("length", "stop")
    assert [(r.ttft_slo_s, r.tbt_slo_s) for r in seen] == [(5.0, 0.5), (None, None)]


def test_raw_sse_by_hand(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        buf = ""
        for piece in r.iter_text():
            buf += piece
            while "\n\n" in buf:
                event, buf = buf.split("\n\n", 1)
                assert event.startswith("data: "), event
                events.append(event[len("data: "):])
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert all(p["object"] == "text_completion" for p in payloads)
    assert payloads[-1]["usage"] == {"prompt_tokens": payloads[-1]["usage"]["prompt_tokens"],
                                     "completion_tokens": 5,
                                     "total_tokens": payloads[-1]["usage"]["prompt_tokens"] + 5,
                                     "prompt_tokens_details": {"cached_tokens": 0}}
    assert payloads[-2]["choices"][0]["finish_reason"] == "length"


def _scrape(server) -> dict[tuple[str, tuple], float]:
    text = httpx.get(server.url + "/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return values


def test_metrics_count_the_requests_sent(server, client):
    server.wait_idle()
    before = _scrape(server)
    label = (("model_name", "tiny"),)
    sent_prompt, sent_gen = 0, 0
    for n in (3, 5, 7):
        out = _greedy(client, max_tokens=n, extra_body={"ignore_eos": True})
        sent_prompt += out.usage.prompt_tokens
        sent_gen += out.usage.completion_tokens
    server.wait_idle()
    after = _scrape(server)

    def delta(name, labels=label):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert delta("vllm:prompt_tokens_total") == sent_prompt
    assert delta("vllm:generation_tokens_total") == sent_gen == 15
    assert delta("vllm:request_success_total",
                 (("finished_reason", "length"), ("model_name", "tiny"))) == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 15 - 3
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                  "vllm:kv_cache_usage_perc"):
        assert (gauge, label) in after
    assert after[("vllm:kv_cache_usage_perc", label)] == 0.0


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, client):
    """The openai client sees usage.prompt_tokens_details.cached_tokens, and /metrics
    counts the queried and the cached prompt tokens."""
    server.wait_idle()
    before = _scrape(server)
    prompt = "w7 w8 w9 " * 12 + f"w{uuid.uuid4().int % 200 + 3}"  # fresh: not cached yet
    first = _greedy(client, prompt=prompt, max_tokens=2)
    second = _greedy(client, prompt=prompt, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    n = second.usage.prompt_tokens
    assert cached == 8 * ((n - 1) // 8)  # every full page of 8 but the last token's
    assert second.choices[0].text == first.choices[0].text
    server.wait_idle()
    after = _scrape(server)
    label = (("model_name", "tiny"),)

    def delta(name):
        return after.get((name, label), 0) - before.get((name, label), 0)

    assert delta("vllm:prefix_cache_queries_total") == 2 * n
    assert delta("vllm:prefix_cache_hits_total") == cached


def test_sse_events_survive_unicode_line_separators():
    """Generated text may hold U+2028 / U+0085 / \\x1c; each event must stay one line even
    for clients that split like str.splitlines."""
    from serving.formatting import sse

    raw = sse({"text": "a\u2028b\x85c\x1cd\re\nf"}).decode()
    assert raw.endswith("\n\n") and len(raw[:-2].splitlines()) == 1
    assert json.loads(raw[len("data: "):])["text"] == "a\u2028b\x85c\x1cd\re\nf"
