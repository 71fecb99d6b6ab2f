"""Soak test of the OpenAI server: concurrent streaming clients, random disconnects and
malformed requests for a fixed time; then check nothing leaked.

    python bench/soak.py                          # starts `python -m serving --model default`
    python bench/soak.py --url http://127.0.0.1:8000 --model default --duration 60

Prints requests completed / cancelled / failed / rejected, 5xx count, leaked KV pages
(from /metrics once the server is idle) and p50/p99 TTFT and TBT as clients see them.

``--overload`` reproduces an overload from outside: prompts of 20-400 words (long ones
near the context limit), per-request TTFT SLOs (some of 1 ms: late at once), more load
than the machine serves. It also reports the longest wait for a first token, requests
admitted but never served, and the gauges one second after the last client left.
A request "fails" if it got a 5xx, a broken or truncated stream, or a token count other
than the max_tokens it asked for (every request sets ignore_eos). The same ``run_load``
drives the bounded reliability test in tests/serving.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import statistics
import sys
import time

import httpx

from conflux_jax.bench.server_process import ServerProcess

MALFORMED = [  # (body bytes, what it exercises); each must be answered with a 4xx
    (b'{"model": "MODEL", "prompt": ', "truncated JSON"),
    (b'{"model": "MODEL", "prompt": "hi", "temperature": -3}', "bad temperature"),
    (b'{"model": "MODEL", "prompt": "hi", "n": 17}', "n > 16"),
    (b'{"model": "no-such-model", "prompt": "hi"}', "unknown model"),
    (b'{"model": "MODEL", "messages": "not a list"}', "bad messages"),
    (b'{"model": "MODEL", "prompt": LONG}', "prompt over the context"),
    (b'[1, 2, 3]', "not an object"),
    (b'{"model": "MODEL", "prompt": "hi", "max_tokens": "many"}', "max_tokens type"),
]


@dataclasses.dataclass
class Report:
    completed: int = 0
    cancelled: int = 0
    failed: int = 0
    malformed_ok: int = 0  # malformed requests answered with a 4xx, as they should be
    rejected: int = 0  # 429 / 503: the server asked us to come back later
    server_errors: int = 0  # 5xx
    leaked_pages: float | None = None
    never_served: int = 0  # admitted (200) but no first token before the client gave up
    gauges_after: dict[str, float] | None = None  # /metrics 1 s after the load ended
    ttft_s: list[float] = dataclasses.field(default_factory=list)
    tbt_s: list[float] = dataclasses.field(default_factory=list)
    failures: list[str] = dataclasses.field(default_factory=list)
    elapsed_s: float = 0.0

    def fail(self, why: str) -> None:
        self.failed += 1
        if len(self.failures) < 20:
            self.failures.append(why)

    def summary(self) -> str:
        def pct(xs: list[float], q: float) -> str:
            if not xs:
                return "n/a"
            xs = sorted(xs)
            return f"{1000 * xs[min(len(xs) - 1, int(q * len(xs)))]:.1f} ms"

        lines = [
            f"elapsed        {self.elapsed_s:.1f} s",
            f"completed      {self.completed}",
            f"cancelled      {self.cancelled}",
            f"failed         {self.failed}",
            f"malformed->4xx {self.malformed_ok}",
            f"rejected 429   {self.rejected}",
            f"5xx            {self.server_errors}",
            f"leaked pages   {self.leaked_pages if self.leaked_pages is not None else 'n/a'}",
            f"TTFT p50/p99   {pct(self.ttft_s, 0.5)} / {pct(self.ttft_s, 0.99)}",
            f"TBT  p50/p99   {pct(self.tbt_s, 0.5)} / {pct(self.tbt_s, 0.99)}",
            f"TTFT max       {1000 * max(self.ttft_s):.1f} ms" if self.ttft_s else "TTFT max n/a",
            f"never served   {self.never_served}",
        ]
        if self.gauges_after is not None:
            lines.append("gauges +1 s    " + ", ".join(
                f"{k.split(':')[-1]}={v:g}" for k, v in self.gauges_after.items()))
        if self.ttft_s:
            lines.append(f"TTFT mean      {1000 * statistics.fmean(self.ttft_s):.1f} ms")
        lines += [f"  failure: {f}" for f in self.failures]
        return "\n".join(lines)


PROMPTS = ["The quick brown fox", "def add(a, b):", "Checkpoints, tokenizers and conversion",
           "Once upon a time", "Unicode: café naïve", "print(add(2, 40))"]


WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "was", "on",
         "by", "be", "this", "are", "from", "or", "at")


async def _stream_one(client: httpx.AsyncClient, model: str, rng: random.Random,
                      report: Report, disconnect: bool, max_tokens: int,
                      headers: dict[str, str], overload: bool = False) -> None:
    chat = rng.random() < 0.5
    if overload:  # 20-400 words, and a third of them late from the start (1 ms TTFT)
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400)))
    else:
        prompt = rng.choice(PROMPTS) * rng.randint(1, 4)
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": True,
                  "ignore_eos": True, "temperature": rng.choice([0.0, 0.7, 1.0]),
                  "stream_options": {"include_usage": True}}
    if overload and rng.random() < 1 / 3:
        body["ttft_slo_ms"] = 1
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2**31)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    cut = rng.randint(1, max(1, max_tokens - 1)) if disconnect else None
    start = time.perf_counter()
    tokens, last, usage, finish, done = 0, None, None, None, False
    try:
        async with client.stream("POST", path, json=body, headers=headers) as r:
            if r.status_code in (429, 503):
                report.rejected += 1
                return
            if r.status_code >= 500:
                report.server_errors += 1
                report.fail(f"{path}: {r.status_code}")
                return
            if r.status_code != 200:
                report.fail(f"{path}: unexpected {r.status_code} {await r.aread()!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    report.fail(f"{path}: error event {event['error'].get('message')}")
                    return
                if event.get("usage"):
                    usage = event["usage"]
                for choice in event.get("choices", []):
                    delta = choice.get("delta", {})
                    if chat and "role" in delta:
                        continue  # the role chunk carries no token
                    now = time.perf_counter()
                    if last is None:
                        report.ttft_s.append(now - start)
                    else:
                        report.tbt_s.append(now - last)
                    last = now
                    tokens += 1
                    finish = choice.get("finish_reason") or finish
                if cut is not None and tokens >= cut:
                    report.cancelled += 1
                    return  # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        if last is None and isinstance(exc, httpx.ReadTimeout):
            report.never_served += 1
        report.fail(f"{path}: {type(exc).__name__}: {exc}")
        return
    if not done or usage is None:
        report.fail(f"{path}: stream ended without usage / [DONE]")
    elif usage["completion_tokens"] != max_tokens or tokens != max_tokens \
            or finish != "length":
        report.fail(f"{path}: asked {max_tokens} tokens, usage {usage['completion_tokens']}, "
                    f"chunks {tokens}, finish {finish}")
    else:
        report.completed += 1


async def _malformed_one(client: httpx.AsyncClient, model: str, rng: random.Random,
                         report: Report, headers: dict[str, str], context: int) -> None:
    raw, what = rng.choice(MALFORMED)
    long_prompt = json.dumps("hello world " * (context + 8))
    raw = raw.replace(b"MODEL", model.encode()).replace(b"LONG", long_prompt.encode())
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    try:
        r = await client.post(path, content=raw,
                              headers={**headers, "Content-Type": "application/json"})
    except httpx.HTTPError as exc:
        report.fail(f"malformed ({what}): {type(exc).__name__}: {exc}")
        return
    if r.status_code >= 500:
        report.server_errors += 1
        report.fail(f"malformed ({what}): {r.status_code}")
    elif 400 <= r.status_code < 500 and "error" in r.json():
        report.malformed_ok += 1
    else:
        report.fail(f"malformed ({what}): answered {r.status_code}")


async def run_load(url: str, *, model: str, duration_s: float, clients: int = 32,
                   disconnect_frac: float = 0.2, malformed_frac: float = 0.15,
                   max_tokens: tuple[int, int] = (4, 32), seed: int = 0,
                   api_key: str | None = None, context: int = 256,
                   max_requests: int | None = None, overload: bool = False,
                   timeout_s: float = 120.0) -> Report:
    """``clients`` concurrent loops until ``duration_s`` (or ``max_requests``) is spent."""
    report = Report()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + duration_s
    started = 0
    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients)
    t0 = time.perf_counter()

    async def worker(i: int) -> None:
        nonlocal started
        rng = random.Random(seed * 1000 + i)
        async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
            while time.monotonic() < deadline and (max_requests is None
                                                   or started < max_requests):
                started += 1
                if rng.random() < malformed_frac:
                    await _malformed_one(client, model, rng, report, headers, context)
                else:
                    await _stream_one(client, model, rng, report,
                                      rng.random() < disconnect_frac,
                                      rng.randint(*max_tokens), headers, overload)

    await asyncio.gather(*(worker(i) for i in range(clients)))
    report.elapsed_s = time.perf_counter() - t0
    return report


def scrape(url: str) -> dict[str, float]:
    """Unlabelled-by-model view of /metrics: {sample name: value} (first series each)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            out.setdefault(s.name, s.value)
    return out


def leaked_pages(url: str, idle_timeout_s: float = 60.0) -> float:
    """Wait until the server holds no request, then report the KV pages still in use."""
    deadline = time.monotonic() + idle_timeout_s
    while True:
        m = scrape(url)
        busy = m.get("vllm:num_requests_running", 0) + m.get("vllm:num_requests_waiting", 0)
        if busy == 0 or time.monotonic() > deadline:
            return m.get("conflux:kv_pages_used", float("nan"))
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default=None, help="a running server (default: start one)")
    p.add_argument("--model", default="default")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--disconnect-frac", type=float, default=0.2)
    p.add_argument("--malformed-frac", type=float, default=0.15)
    p.add_argument("--max-tokens", type=int, nargs=2, default=(4, 32), metavar=("MIN", "MAX"))
    p.add_argument("--context", type=int, default=2048, help="server context, for the "
                   "too-long-prompt case")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--overload", action="store_true",
                   help="20-400-word prompts, a third with a 1 ms TTFT SLO (see above)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a client waits for a response before it gives up")
    p.add_argument("server_args", nargs="*", help="extra `python -m serving` arguments "
                   "(after --), when this script starts the server")
    args = p.parse_args(argv)
    server = None
    url = args.url
    if url is None:
        server = ServerProcess(["--model", args.model, "--served-model-name",
                                args.served_model_name or args.model, *args.server_args],
                               ready_timeout_s=args.ready_timeout)
        url = server.url
    name = args.served_model_name or args.model
    try:
        report = asyncio.run(run_load(
            url, model=name, duration_s=args.duration, clients=args.clients,
            disconnect_frac=args.disconnect_frac, malformed_frac=args.malformed_frac,
            max_tokens=tuple(args.max_tokens), seed=args.seed, api_key=args.api_key,
            context=args.context, overload=args.overload, timeout_s=args.timeout))
        time.sleep(1.0)  # gauges must be true within a second of the last client leaving
        gauges = scrape(url)
        report.gauges_after = {k: gauges.get(k, float("nan")) for k in (
            "vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc", "conflux:kv_pages_used")}
        report.leaked_pages = leaked_pages(url)
        alive = httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        if server is not None:
            server.stop()
    print(report.summary())
    print(f"server alive   {alive}")
    ok = report.failed == 0 and report.server_errors == 0 and report.leaked_pages == 0 \
        and report.never_served == 0 and alive
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
