"""The global router in front of several engine instances, in one process: the OpenAI app
over a ``RoutedLoop`` whose instances are ``InstanceServer``s on two real tiny engines.

What it checks over HTTP: a burst of distinct prompts reaches both instances, a repeated
long prefix goes back to the instance that cached it, /metrics sums the instances, an
instance whose executor is lost stops getting requests (its open one fails), and one that
stalls fails its request with an error naming it. Faults are injected at the executor
boundary, as in test_instance_lost.py. The same routing over Ray Serve replicas is in
test_ray_app.py.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from serving_helpers import serving_tiny_engine

from conflux_jax.bench.server_process import free_port
from conflux_jax.plan import ExecutorLost
from serving.engine_loop import EngineLoop
from serving.instance import InstanceServer
from serving.request_flow import INSTANCE_HEADER
from serving.routed_loop import RoutedLoop, Timeouts, describe_any

pytestmark = pytest.mark.timeout(300)


class RoutedServer:
    """uvicorn on its own event loop thread, serving ``create_app`` over a RoutedLoop."""

    def __init__(self, engines: list[Any], timeouts: Timeouts, policy: str) -> None:
        import uvicorn

        from serving.app import create_app
        from serving.http_protocol import uvicorn_config
        from serving.settings import ServerSettings

        self.engines = engines
        self.loops = [EngineLoop(e) for e in engines]
        for loop in self.loops:
            loop.start(warmup=False)
        self.instances = [InstanceServer(f"instance-{i}", loop)
                          for i, loop in enumerate(self.loops)]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        started = threading.Event()

        async def main() -> None:
            info = await describe_any(self.instances, 5.0)
            self.routed = RoutedLoop(self.instances, info, policy=policy, timeouts=timeouts)
            await self.routed.start()
            settings = ServerSettings(model_name="tiny", max_model_len=info.max_model_len,
                                      max_logprobs=info.max_logprobs,
                                      stop_loop_on_shutdown=True)
            app = self.app = create_app(self.routed, settings)
            self.server = uvicorn.Server(uvicorn_config(
                app, host="127.0.0.1", port=self.port, log_level="warning", access_log=False))
            started.set()
            await self.server.serve()

        self.thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
        self.thread.start()
        assert started.wait(30), "the routed server did not start"
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive()
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        for loop in self.loops:
            loop.stop(drain=False, timeout=30)


@pytest.fixture(scope="module")
def second_engine(tiny_checkpoint: Any) -> Any:
    return serving_tiny_engine(tiny_checkpoint)


@pytest.fixture(scope="module")
def routed(tiny_engine: Any, second_engine: Any) -> Iterator[RoutedServer]:
    server = RoutedServer([tiny_engine, second_engine],
                          Timeouts(report_s=5.0, start_s=30.0, output_s=30.0,
                                   poll_interval_s=0.2), policy="conflux")
    yield server
    server.stop()
    for engine in server.engines:
        assert not engine.has_unfinished


def _complete(url: str, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 0})


def _burst(url: str, prompts: list[list[int]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(
                url + "/v1/completions", json={"model": "tiny", "prompt": p, "max_tokens": 4,
                                               "ignore_eos": True}) for p in prompts))
    return asyncio.run(go())


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    found = re.findall(rf'^{re.escape(name)}\{{[^}}]*\}} (\S+)$', text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found[0])


def test_load_reports_come_from_the_engine_thread_and_a_stopped_loop_refuses_them(
        second_engine: Any) -> None:
    """First in the module: the routed server's loops drive the engines after it."""
    from serving.engine_loop import EngineLoopClosed

    loop = EngineLoop(second_engine)
    with pytest.raises(EngineLoopClosed):  # not started
        loop.load_report([1, 2, 3]).result(timeout=5)
    loop.start(warmup=False)
    try:
        load = loop.load_report(list(range(3, 40)), max_new_tokens=8).result(timeout=10)
        assert load.queued_tokens == 0 and load.decodes == 0 and load.predicted_ttft_s > 0
        assert load.num_ranks == second_engine.executor.num_ranks
        with pytest.raises(ValueError, match="token ids must be in"):  # EngineError
            loop.load_report([10**6]).result(timeout=10)
    finally:
        loop.stop(timeout=10)
    with pytest.raises(EngineLoopClosed):
        loop.load_report([1, 2, 3]).result(timeout=5)


def test_a_burst_of_distinct_prompts_reaches_both_instances(routed: RoutedServer) -> None:
    prompts = [[10 + i, 20 + i, 30 + i, 40 + i] for i in range(6)]
    responses = _burst(routed.url, prompts)
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    served = [r.headers[INSTANCE_HEADER] for r in responses]
    assert set(served) == {"instance-0", "instance-1"}, served
    assert all(len(r.json()["choices"][0]["text"]) >= 0 and
               r.json()["usage"]["completion_tokens"] == 4 for r in responses)


def test_a_repeated_long_prefix_goes_to_the_instance_that_cached_it(
        routed: RoutedServer) -> None:
    prefix = [(7 * i) % 250 + 3 for i in range(96)]  # 12 full pages of 8 tokens
    first = _complete(routed.url, prefix + [5])
    assert first.status_code == 200, first.text
    owner = first.headers[INSTANCE_HEADER]
    for tail in ([6], [7, 8]):
        again = _complete(routed.url, prefix + tail)
        assert again.status_code == 200, again.text
        assert again.headers[INSTANCE_HEADER] == owner
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 88


def test_metrics_sum_the_instances(routed: RoutedServer) -> None:
    assert _complete(routed.url, [3, 1, 4, 1, 5, 9, 2, 6]).status_code == 200
    expected = sum(e.scheduler.prefix_queries for e in routed.engines)
    deadline = time.monotonic() + 10
    while _metric(routed.url, "vllm:prefix_cache_queries_total") != expected:
        assert time.monotonic() < deadline, "the summed prefix queries never showed"
        time.sleep(0.1)
    assert expected > max(e.scheduler.prefix_queries for e in routed.engines) > 0
    # Each loop publishes its stats after a step: the reply can reach us first.
    while _metric(routed.url, "vllm:num_requests_running") != 0:
        assert time.monotonic() < deadline, "a finished request still counted as running"
        time.sleep(0.1)



def test_an_invalid_prompt_is_the_clients_error_not_an_instance_failure(
        routed: RoutedServer) -> None:
    r = _complete(routed.url, list(range(3, 303)))  # longer than the 256-token context
    assert r.status_code == 400
    assert "this server's context is 256 tokens" in r.json()["error"]["message"]
    assert routed.routed.down == {}
    assert _complete(routed.url, [9, 8, 7]).status_code == 200


def test_the_router_refuses_what_it_cannot_route(routed: RoutedServer) -> None:
    info = routed.routed.engine
    with pytest.raises(ValueError, match="at least one engine instance"):
        RoutedLoop([], info)
    with pytest.raises(ValueError, match="names must differ"):
        RoutedLoop([routed.instances[0], routed.instances[0]], info)
    with pytest.raises(ValueError, match="unknown router policy 'random'"):
        RoutedLoop(routed.instances, info, policy="random")
    with pytest.raises(ValueError, match="output_s must be positive"):
        Timeouts(output_s=0)

def _stream_events(url: str, prompt: list[int], max_tokens: int,
                   on_first: Any = None) -> tuple[str, list[Any]]:
    """The serving instance and the stream's events; ``on_first(instance)`` runs once the
    first token is in."""
    events: list[Any] = []
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        served = r.headers[INSTANCE_HEADER]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if on_first is not None and len(events) == 1:
                on_first(served)
    return served, events


def test_a_stalled_instance_fails_its_request_with_an_error_naming_it(
        routed: RoutedServer) -> None:
    """An instance that stops producing (each step now takes seconds) fails the request
    it holds once the output timeout passes: an error event naming the instance, then
    the next requests are served (the stall is over)."""
    slowed: dict[int, Any] = {}

    def slow_down(name: str) -> None:
        i = int(name.rsplit("-", 1)[1])
        executor = routed.engines[i].executor
        real = executor.launch  # how the engine starts each plan

        def slow(plan: Any, prepare: Any = None, after: Any = None) -> Any:
            time.sleep(1.5)
            return real(plan, prepare, after)

        slowed[i] = (executor, real)
        executor.launch = slow

    old = routed.routed.timeouts
    routed.routed.timeouts = Timeouts(report_s=5.0, start_s=30.0, output_s=0.5,
                                      poll_interval_s=0.2)
    try:
        served, events = _stream_events(routed.url, [11, 12, 13, 14], 200, slow_down)
    finally:
        routed.routed.timeouts = old
        for executor, real in slowed.values():
            executor.launch = real
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events[-3:]
    message = errors[0]["error"]["message"]
    assert f"engine instance {served} failed" in message and "sent nothing" in message
    assert errors[0]["error"]["code"] == 502
    assert _complete(routed.url, [1, 2, 3]).status_code == 200
    deadline = time.monotonic() + 30
    while any(e.has_unfinished for e in routed.engines):  # the abort reached the engine
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_stall_fails_a_whole_non_streaming_request_with_a_502(routed: RoutedServer) -> None:
    """Both choices of an n=2 request stall (every step now takes seconds): a 502 naming
    the instance, and neither choice is left running or counted in flight."""
    reals = [(e.executor, e.executor.launch) for e in routed.engines]

    def slowed(real: Any) -> Any:
        def slow(plan: Any, prepare: Any = None, after: Any = None) -> Any:
            time.sleep(1.5)
            return real(plan, prepare, after)
        return slow

    old = routed.routed.timeouts
    routed.routed.timeouts = Timeouts(report_s=5.0, start_s=30.0, output_s=0.5,
                                      poll_interval_s=0.2)
    try:
        for executor, real in reals:
            executor.launch = slowed(real)
        r = httpx.post(routed.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": [61, 62, 63], "max_tokens": 50,
                             "ignore_eos": True, "n": 2})
    finally:
        routed.routed.timeouts = old
        for executor, real in reals:
            executor.launch = real
    assert r.status_code == 502, r.text
    assert re.search(r"engine instance instance-\d failed .*sent nothing for 0.5 s",
                     r.json()["error"]["message"])
    deadline = time.monotonic() + 30
    while routed.app.state.server.inflight or any(e.has_unfinished for e in routed.engines):
        assert time.monotonic() < deadline, "a choice was left running"
        time.sleep(0.05)

def test_a_lost_instance_fails_its_request_and_the_other_serves_the_rest(
        routed: RoutedServer) -> None:
    """Last in the module: it stops one instance's engine loop for good."""
    lost: list[Any] = []

    def lose(name: str) -> None:
        i = int(name.rsplit("-", 1)[1])
        executor = routed.engines[i].executor

        def gone(plan: Any, prepare: Any = None, after: Any = None) -> Any:
            raise ExecutorLost("process 1 of 2 died")

        lost.append((executor, executor.launch, name))
        executor.launch = gone

    try:
        served, events = _stream_events(routed.url, [21, 22, 23, 24], 200, lose)
        assert events[-1] == "[DONE]"
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        assert len(errors) == 1 and errors[0]["error"]["code"] == 500
        for i in range(4):
            r = _complete(routed.url, [30 + i, 31, 32])
            assert r.status_code == 200, r.text
            assert r.headers[INSTANCE_HEADER] != served
        assert httpx.get(routed.url + "/health", timeout=10).status_code == 200
    finally:
        for executor, real, _ in lost:
            executor.launch = real


def test_summed_counters_only_go_up_across_an_instance_restart() -> None:
    from serving.engine_loop import Stats
    from serving.routed_loop import _Totals

    totals = _Totals(2)
    s = totals.add([Stats(running=1, steps=10, prefix_queries=100, kv_usage=0.5),
                    Stats(running=2, steps=5, prefix_queries=50, kv_usage=0.1)])
    assert (s.running, s.steps, s.prefix_queries) == (3, 15, 150)
    assert s.kv_usage == pytest.approx(0.3)
    s = totals.add([Stats(steps=12, prefix_queries=100), None])  # instance 1 is down
    assert (s.running, s.steps, s.prefix_queries) == (0, 17, 150)
    s = totals.add([Stats(steps=12, prefix_queries=100), Stats(steps=3, prefix_queries=8)])
    assert (s.steps, s.prefix_queries) == (20, 158)  # restarted from zero: all new
