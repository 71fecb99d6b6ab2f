"""bench serve: the in-process engine driver (tiny model), the streaming client (mock
server), the rate sweep and the CLI end to end on the tiny engine."""

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator

import jax
import pytest
from aiohttp import web
from shared_data import needs_traces
from tiny_models import TINY_LLAMA

import conflux_jax.bench.serve as serve
from conflux_jax.bench.__main__ import main
from conflux_jax.bench.metrics import RequestResult, summarize
from conflux_jax.bench.serve_workload import (
    LengthScaling,
    Row,
    ServeRequest,
    multi_turn,
    reusable_tokens,
)
from conflux_jax.engine import Engine, EngineConfig
from conflux_jax.executor.buckets import BucketConfig
from conflux_jax.executor.jax_executor import ExecutorConfig
from conflux_jax.models.decoder import random_params
from conflux_jax.tokenizer import Tokenizer

needs4 = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 (simulated) devices")


def tiny_engine(*_: object, enable_prefix_caching: bool = True, local_prefill: bool = True,
                **__: object) -> Engine:
    ec = ExecutorConfig(mesh="sp=4,tp=1", page_size=4, num_pages=128, max_model_len=128,
                        buckets=BucketConfig(tokens=(8, 32), decode=(16,), max_prefill_seqs=4))
    return Engine(TINY_LLAMA, random_params(TINY_LLAMA, seed=1, scale=0.2),
                  Tokenizer.word_level(TINY_LLAMA.vocab_size),
                  EngineConfig(executor=ec, ttft_slo_s=5.0, tbt_slo_s=1.0,
                               enable_prefix_caching=enable_prefix_caching,
                               local_prefill=local_prefill))


@needs4
def test_run_engine_streams_every_token() -> None:
    engine = tiny_engine()
    reqs = [ServeRequest(0.05 * i, list(range(3, 3 + 5 + 3 * i)), 4 + i) for i in range(5)]
    results, duration = serve.run_engine(engine, reqs)
    assert all(r.success for r in results)
    assert [r.output_len for r in results] == [4, 5, 6, 7, 8]  # ignore_eos
    assert all(len(r.token_times) == r.output_len and r.ttft > 0 for r in results)
    m = summarize(results, duration, ttft_slo_s=60.0, tbt_slo_s=60.0)
    assert m["deadline_attainment"] == 1.0 and m["total_output_tokens"] == 30


@contextlib.contextmanager
def http_server(handler: Callable[[web.Request], Awaitable[web.Response]]) -> Iterator[str]:
    """A real HTTP server on a local port (aiohttp.web on its own thread) that answers
    ``POST /v1/completions`` with ``handler``; yields its base URL."""
    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    loop.run_until_complete(web.SockSite(runner, sock).start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


async def _sse(request: web.Request) -> web.Response:
    body = await request.json()
    assert body["stream"] and body["ignore_eos"] and isinstance(body["prompt"], list)
    n = body["max_tokens"]
    chunks = [{"choices": [{"index": 0, "text": f" t{i}", "token_ids": [50 + i]}]}
              for i in range(n)]
    cached = 4 * ((len(body["prompt"]) - 1) // 8)  # a stand-in for the server's count
    chunks.append({"choices": [], "usage": {"prompt_tokens": len(body["prompt"]),
                                            "completion_tokens": n,
                                            "prompt_tokens_details": {"cached_tokens": cached}}})
    text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    return web.Response(text=text, content_type="text/event-stream")


async def _boom(request: web.Request) -> web.Response:
    return web.Response(status=500, text="boom")


def test_run_server_parses_openai_stream() -> None:
    reqs = [ServeRequest(0.0, [5, 6, 7], 3), ServeRequest(0.01, [8] * 9, 5)]
    with http_server(_sse) as url:
        results, _ = serve.run_server(url, "m", reqs)
    assert [r.output_len for r in results] == [3, 5]
    assert [len(r.token_times) for r in results] == [3, 5]
    assert [r.output_ids for r in results] == [[50, 51, 52], [50, 51, 52, 53, 54]]
    assert all(r.success and r.input_len > 0 for r in results)

    with http_server(_boom) as url:
        (bad,), _ = serve.run_server(url, "m", reqs[:1])
    assert not bad.success and "500" in bad.error and "boom" in bad.error


def test_sweep_bisects_to_goodput() -> None:
    def run(reqs):  # attainment drops once the rate passes 2 req/s
        rate = reqs[0].max_tokens / 10
        late = 1.0 if rate > 2.0 else 0.0
        return [RequestResult(0.0, 1, [0.1 + late], 1, True)], 1.0

    make = lambda rate: [ServeRequest(0.0, [1], int(rate * 10))]  # noqa: E731
    per_rate = serve.sweep(run, make, [1.0, 4.0], bisect=2, ttft_slo_s=0.5, tbt_slo_s=0.1)
    assert list(per_rate) == [1.0, 1.75, 2.5, 4.0]  # 1 ok, 4 late; bisect: 2.5 late, 1.75 ok
    assert serve.goodput(per_rate) == 1.75


@needs4
@needs_traces
def test_serve_cli_in_process_on_conversation_trace(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(serve, "engine_from_model", tiny_engine)
    out = tmp_path / "s.json"
    assert main(["serve", "--trace", "conversation", "--num-prompts", "6", "--rates", "2", "8",
                 "--prompt-scale", "0.004", "--max-prompt-len", "30", "--output-scale", "0.01",
                 "--max-output-len", "6", "--ttft-slo", "30", "--tbt-slo", "10",
                 "--warmup", "2", "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    assert d["goodput_rps"] == 8.0
    assert d["scaling"]["max_prompt_len"] == 30 and d["scaling"]["lengths"]["prompt"]["max"] <= 30
    assert d["rates"]["2"]["completed"] == 6 and d["rates"]["2"]["deadline_attainment"] == 1.0
    text = capsys.readouterr().out
    assert "Serving Benchmark Result @ 8 req/s" in text and "goodput_rps" in text


def test_run_server_sends_follow_up_turns_with_the_answers_it_got() -> None:
    reqs = [ServeRequest(0.0, [5, 6, 7], 2), ServeRequest(0.0, [9], 3, follows=0),
            ServeRequest(0.0, [8], 1, follows=1)]
    with http_server(_sse) as url:
        results, _ = serve.run_server(url, "m", reqs)
    assert [r.prompt_ids for r in results] == [[5, 6, 7], [5, 6, 7, 50, 51, 9],
                                               [5, 6, 7, 50, 51, 9, 50, 51, 52, 8]]
    assert all(b.send_s >= a.token_times[-1] for a, b in zip(results, results[1:], strict=False))
    assert [r.cached_tokens for r in results] == [0, 0, 4]  # read from usage


def test_multi_turn_chats_and_the_brute_force_reuse_count() -> None:
    rows = [Row(float(i), 640, 64, (i % 2, 10 + i)) for i in range(6)]
    reqs = multi_turn(rows, 3, LengthScaling(1 / 32, 1 / 16), LengthScaling(1 / 64), (3, 99))
    assert [r.follows for r in reqs] == [None, 0, 1, None, 3, 4]
    assert [len(r.prompt_ids) for r in reqs] == [20, 10, 10, 20, 10, 10]
    # brute force by hand, pages of 4: B repeats A's 8 tokens (+1 of its own, +3 fresh);
    # C repeats B's whole KV but its last generated token (never fed back)
    a, b_out = [1] * 4 + [2] * 4, [7, 7]
    b = a + [3] * 4
    c = b + b_out + [4]
    assert reusable_tokens([a, b, c], [[5], b_out, [6]], 4) == 8 + 12
    assert reusable_tokens([a, b, c], [[5], b_out, [6]], 4, pool_pages=1) == 0 + 0
    assert reusable_tokens([a, a + [9]], [[5, 5], [5]], 4) == 8  # the last token computes


@needs4
def test_serve_cli_prefix_caching_ab_on_a_multi_turn_replay(tmp_path, monkeypatch, capsys
                                                            ) -> None:
    """Caching on vs off on the same chats, and on without owner-alone suffixes: the
    engine's cached tokens are counted by the replay and match what the replay made
    reusable; off caches nothing."""
    monkeypatch.setattr(serve, "engine_from_model", tiny_engine)
    rows = [{"timestamp": 10 * i, "input_length": 1500, "output_length": 64,
             "hash_ids": [0, 1, 100 + i]} for i in range(6)]
    trace = tmp_path / "chat.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    out = tmp_path / "ab.json"
    assert main(["serve", "--trace", str(trace), "--num-prompts", "6", "--turns", "3",
                 "--rates", "4", "--prompt-scale", "0.01", "--max-prompt-len", "16",
                 "--output-scale", "0.1", "--max-output-len", "6", "--turn-prompt-scale",
                 "0.004", "--ttft-slo", "30", "--tbt-slo", "10", "--max-model-len", "128",
                 "--warmup", "0", "--prefix-caching-ab", "--local-prefill-ab",
                 "--json", str(out)]) == 0
    d = json.loads(out.read_text())
    on, loads_only, off = (t["rates"]["4"] for t in d["targets"].values())
    assert on["completed"] == off["completed"] == loads_only["completed"] == 6
    assert off["total_cached_tokens"] == 0 and on["total_cached_tokens"] > 0
    assert loads_only["total_cached_tokens"] > 0
    assert d["local_prefill_ab"]["4"]["ttft_p50_load_over_local"] > 0
    ab = d["prefix_caching_ab"]["4"]
    assert ab["cached_tokens"] == on["total_cached_tokens"]
    assert ab["cached_over_reusable_in_pool"] >= 0.9
    printed = capsys.readouterr().out
    assert "prefix caching on vs off" in printed and "owner-alone suffixes on vs off" in printed
