"""The CLI as users run it: a subprocess, warm-up bar + one ready line, the README's curl
and openai examples, SIGTERM draining in-flight requests; SmolLM2 end to end (slow)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest
from serving_helpers import REPO, TINY_CLI_ARGS, CliServer

README_PORT = "127.0.0.1:8000"


def readme_examples() -> tuple[str, str]:
    """The curl command and the openai snippet of the README's Serving section."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Serving", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    curl = next(code for lang, code in blocks if lang == "bash" and "curl" in code)
    python = next(code for lang, code in blocks if lang == "python")
    assert README_PORT in curl and README_PORT in python
    return curl, python


def run_readme_examples(url_hostport: str) -> tuple[dict, str]:
    """Both run at once, as two users would (the server batches them)."""
    curl, python = readme_examples()
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in (["bash", "-c", curl.replace(README_PORT, url_hostport)],
                         [sys.executable, "-c", python.replace(README_PORT, url_hostport)])]
    try:
        (curl_out, curl_err), (py_out, py_err) = (p.communicate(timeout=300) for p in procs)
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == 0, curl_err
    assert procs[1].returncode == 0, py_err
    return json.loads(curl_out), py_out


@pytest.fixture(scope="module")
def cli(tmp_path_factory, tiny_checkpoint):
    log = tmp_path_factory.mktemp("cli") / "server.log"
    server = CliServer(["--model", str(tiny_checkpoint), "--served-model-name", "default",
                        *TINY_CLI_ARGS], log, ready_timeout=180)
    yield server
    server.stop()


def test_makefile_serve_runs_the_cli_on_the_default_model():
    makefile = (REPO / "Makefile").read_text()
    recipe = makefile.split("\nserve:", 1)[1].split("\n\n", 1)[0]
    assert "setup" in recipe.splitlines()[0]
    assert "$(PY) -m serving --model default" in recipe
    assert "make serve" in (REPO / "README.md").read_text().split("## Serving", 1)[1]


def test_warmup_bar_and_one_ready_line(cli):
    log = cli.log()
    assert "compiling buckets" in log
    ready = [line for line in log.splitlines() if "ready:" in line]
    assert len(ready) == 1, log
    assert f"{cli.url}/v1" in ready[0]
    # No --mesh on CPU: one host device (simulated ranks would share the same cores).
    assert "mesh sp=1,tp=1" in ready[0]


def test_readme_examples_against_the_live_server(cli):
    body, printed = run_readme_examples(cli.url.removeprefix("http://"))
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["completion_tokens"] >= 1
    assert isinstance(printed, str)


def test_bad_model_exits_with_a_message(tmp_path):
    out = subprocess.run([sys.executable, "-m", "serving", "--model", str(tmp_path / "nope")],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2
    assert "cannot start" in out.stderr and "nope" in out.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--num-processes", "2"], "needs the process count and this process's id"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "0",
      "--mesh", "sp=3"], "does not split over 2 processes"),
])
def test_a_partial_or_unsplittable_multi_process_setting_is_refused(args, message):
    """Refused before anything starts (the multi-process instance itself: test_multihost)."""
    out = subprocess.run([sys.executable, "-m", "serving", *args], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2
    assert "cannot start" in out.stderr and message in out.stderr


def test_sigterm_drains_in_flight_requests_then_exits(cli):
    body = {"model": "default", "prompt": "hi", "max_tokens": 120, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", cli.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if len(events) == 3:
                cli.proc.send_signal(signal.SIGTERM)
                time.sleep(0.3)
                # Draining: no new connections are taken.
                with pytest.raises(httpx.HTTPError):
                    httpx.post(cli.url + "/v1/completions", json=body, timeout=5)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["usage"]["completion_tokens"] == 120
    assert cli.proc.wait(60) == 0
    assert "SIGTERM" in cli.log()


@pytest.mark.slow
def test_default_model_end_to_end_chat(tmp_path):
    """``make serve``'s command on SmolLM2, the README examples, a real chat answer."""
    server = CliServer(["--model", "default"], tmp_path / "smol.log", ready_timeout=900)
    try:
        body, printed = run_readme_examples(server.url.removeprefix("http://"))
        assert "Paris" in body["choices"][0]["message"]["content"]
        assert "Paris" in printed
    finally:
        assert server.stop() == 0
