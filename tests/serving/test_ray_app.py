"""Two engine instances behind the global router as a Ray Serve application, on a local
Ray cluster and the tiny test model, checked over HTTP on the OpenAI endpoints: load
spreads a burst over both instances, a repeated long prefix returns to the instance that
cached it, and killing one instance's replica (``ray.kill``) mid-stream fails its request
with an error naming it while the next requests go to the other, until Ray Serve's new
replica has warmed up and rejoins.

One cluster and one application for the module (starting them is most of the time).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving_helpers import TINY_CLI_ARGS

pytest.importorskip("ray")
pytest.importorskip("ray.serve")

from conflux_jax.bench.server_process import free_port  # noqa: E402
from serving.request_flow import INSTANCE_HEADER  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    # ray.init starts its processes by fork + exec from this (JAX-threaded) process: the
    # child runs no Python before exec, so the deadlock the warning fears cannot happen.
    pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning"),
]


@pytest.fixture(scope="module")
def ray_app(tiny_checkpoint: Path) -> Iterator[str]:
    import ray
    from ray import serve

    from serving import ray_app

    env = ray_app.local_runtime_env()
    # The test session simulates 4 CPU devices; each instance here is one device.
    env["env_vars"]["XLA_FLAGS"] = ""
    ray.init(num_cpus=4, include_dashboard=False, runtime_env=env,
             log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        # As a serve config's args (the tiny model's flags as the CLI tests pass them).
        tiny = dict(zip(TINY_CLI_ARGS[::2], TINY_CLI_ARGS[1::2], strict=True))
        config = {"model": str(tiny_checkpoint), "served_model_name": "tiny",
                  "instances": 2, "router": "conflux", "instance_cpus": 1,
                  "output_timeout": 30, "report_timeout": 3, "log_level": "warning",
                  **{k[2:].replace("-", "_"): v for k, v in tiny.items()}}
        serve.run(ray_app.app_builder(config), name=ray_app.APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the application never became healthy"
            time.sleep(0.2)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _complete(url: str, prompt: list[int], max_tokens: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                            "ignore_eos": True, "temperature": 0})


def test_the_flags_of_a_serve_config_are_the_command_lines(tiny_checkpoint: Path) -> None:
    from serving import ray_app

    args = ray_app.args_from_config({"model": "default", "instances": 3,
                                     "router": "least-loaded", "token_buckets": [16, 64],
                                     "enable_prefix_caching": False})
    assert (args.instances, args.router, args.token_buckets) == (3, "least-loaded", (16, 64))
    assert args.enable_prefix_caching is False
    with pytest.raises(ValueError, match="unknown application arg 'instancez'"):
        ray_app.args_from_config({"instancez": 2})
    with pytest.raises(ValueError, match="invalid application args"):
        ray_app.args_from_config({"router": "random"})
    with pytest.raises(ValueError, match="not supported under Ray Serve"):
        ray_app.args_from_config({"coordinator": "10.0.0.1:8476"})
    with pytest.raises(ValueError, match="application arg 'port': the Serve config's"):
        ray_app.args_from_config({"port": 9000})


def test_the_example_configs_build_with_their_args() -> None:
    import yaml

    from serving import ray_app

    examples = Path(__file__).resolve().parents[2] / "examples" / "ray"
    serve_config = yaml.safe_load((examples / "serve_config.yaml").read_text())
    service = yaml.safe_load((examples / "rayservice.yaml").read_text())
    for config in (serve_config, yaml.safe_load(service["spec"]["serveConfigV2"])):
        (app,) = config["applications"]
        assert app["import_path"] == "serving.ray_app:app_builder"
        args = ray_app.args_from_config(app["args"])
        assert args.instances == 2 and args.router == "conflux"


def _burst(url: str, n: int) -> list[httpx.Response]:
    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(client.post(
                url + "/v1/completions",
                json={"model": "tiny", "prompt": [10 + i, 20 + i, 30 + i], "max_tokens": 4,
                      "ignore_eos": True}) for i in range(n)))

    responses = asyncio.run(burst())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    return responses


def test_a_burst_of_distinct_prompts_reaches_both_instances(ray_app: str) -> None:
    responses = _burst(ray_app, 6)
    assert {r.headers[INSTANCE_HEADER] for r in responses} == {"instance-0", "instance-1"}
    assert all(r.json()["usage"]["completion_tokens"] == 4 for r in responses)


def test_a_repeated_long_prefix_goes_to_the_instance_that_cached_it(ray_app: str) -> None:
    prefix = [(11 * i) % 250 + 3 for i in range(96)]  # 12 full pages of 8 tokens
    first = _complete(ray_app, prefix + [5])
    assert first.status_code == 200, first.text
    owner = first.headers[INSTANCE_HEADER]
    for tail in ([6], [7, 8]):
        again = _complete(ray_app, prefix + tail)
        assert again.status_code == 200, again.text
        assert again.headers[INSTANCE_HEADER] == owner
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 88


def test_metrics_sum_the_instances(ray_app: str) -> None:
    """/metrics shows the instances' own counters summed (the burst reached both)."""
    from ray import serve

    from serving.ray_app import APP_NAME

    handles = [serve.get_deployment_handle(f"instance-{i}", app_name=APP_NAME)
               for i in range(2)]
    deadline = time.monotonic() + 10
    while True:
        own = [h.stats.remote().result(timeout_s=10).prefix_queries for h in handles]
        text = httpx.get(ray_app + "/metrics", timeout=10).text
        line = next(x for x in text.splitlines()
                    if x.startswith("vllm:prefix_cache_queries_total{"))
        if float(line.rsplit(" ", 1)[1]) == sum(own):
            break
        assert time.monotonic() < deadline, (line, own)
        time.sleep(0.2)
    assert min(own) > 0


def _kill_replica(instance: str) -> None:
    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA") and f"#{instance}#" in a["name"]]
    assert len(names) == 1, names
    ray.kill(ray.get_actor(names[0]["name"], namespace=names[0]["namespace"]))


def test_a_killed_instance_fails_its_request_and_the_other_serves_the_next(
        ray_app: str) -> None:
    body = {"model": "tiny", "prompt": [40, 41, 42, 43], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    events: list[Any] = []
    with httpx.stream("POST", ray_app + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        served = r.headers[INSTANCE_HEADER]
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
                if len(events) == 1:
                    _kill_replica(served)
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    assert len(errors) == 1, events[-3:]
    message = errors[0]["error"]["message"]
    assert f"engine instance {served} failed while generating this request" in message
    assert errors[0]["error"]["code"] == 502
    other = ({"instance-0", "instance-1"} - {served}).pop()
    started = time.monotonic()
    for i in range(3):
        after = _complete(ray_app, [50 + i, 51, 52])
        assert after.status_code == 200, after.text
        assert after.headers[INSTANCE_HEADER] == other
    assert time.monotonic() - started < 30  # no request waited on the dead instance long
    assert httpx.get(ray_app + "/health", timeout=10).status_code == 200


def test_the_restarted_instance_rejoins(ray_app: str) -> None:
    """Ray Serve replaces the killed replica; once warm, the router's poll brings it back
    and bursts reach both instances again."""
    deadline = time.monotonic() + 120
    while True:
        served = {r.headers[INSTANCE_HEADER] for r in _burst(ray_app, 4)}
        if served == {"instance-0", "instance-1"}:
            break
        assert time.monotonic() < deadline, "the killed instance never came back"
        time.sleep(1.0)
