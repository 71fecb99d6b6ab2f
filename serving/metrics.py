"""Prometheus metrics under vLLM's names (label ``model_name``) so vLLM dashboards work.

Each app owns its own ``CollectorRegistry``: several servers in one process (the tests)
never collide, and /metrics shows only this server. Request-level series are recorded on
the event loop when a request ends; gauges are refreshed from the engine loop's stats
snapshot at scrape time.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from serving.engine_loop import Stats

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = r = CollectorRegistry()
        m = ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", m,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", m,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests.",
                                       m + ["finished_reason"], registry=r)
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", m,
            registry=r)
        self.prefix_cache_hits = Counter("vllm:prefix_cache_hits", "Prompt tokens the prefix "
                                         "cache served.", m, registry=r)
        self._prefix_seen = (0, 0)  # the engine's running totals at the last scrape
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", m,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens.", m,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             m, buckets=_LATENCY_BUCKETS, registry=r)
        self.request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request.", m,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.request_generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per request.", m,
            buckets=_TOKEN_BUCKETS, registry=r)
        self.running = Gauge("vllm:num_requests_running", "Requests in the engine past "
                             "admission.", m, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for prefill.", m,
                             registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use "
                              "(1 = full).", m, registry=r)
        # Ours: exact page count (the percentage rounds a single leaked page away).
        self.kv_pages_used = Gauge("conflux:kv_pages_used", "KV pages in use, all ranks.", m,
                                   registry=r)
        # Ours: refused at the door (bad input, queue full, ...), by HTTP status.
        self.rejected = Counter("conflux:requests_rejected", "Requests answered with an "
                                "error status.", m + ["status"], registry=r)
        for c in (self.prompt_tokens, self.generation_tokens, self.prefix_cache_queries,
                  self.prefix_cache_hits, self.ttft, self.itl, self.e2e, self.running,
                  self.waiting, self.kv_usage, self.kv_pages_used, self.request_prompt_tokens,
                  self.request_generation_tokens):
            c.labels(model_name)  # every series exists from the first scrape

    def record_request(self, *, prompt_tokens: int, token_times: list[float],
                       arrival_s: float, end_s: float, finish_reason: str) -> None:
        """One finished (or aborted) request; ``token_times`` are perf_counter stamps."""
        name = self.model_name
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.generation_tokens.labels(name).inc(len(token_times))
        self.request_success.labels(name, finish_reason).inc()
        self.request_prompt_tokens.labels(name).observe(prompt_tokens)
        self.request_generation_tokens.labels(name).observe(len(token_times))
        if token_times:
            self.ttft.labels(name).observe(max(0.0, token_times[0] - arrival_s))
            itl = self.itl.labels(name)
            for a, b in zip(token_times, token_times[1:], strict=False):
                itl.observe(max(0.0, b - a))
        self.e2e.labels(name).observe(max(0.0, end_s - arrival_s))

    def record_rejected(self, status: int) -> None:
        self.rejected.labels(self.model_name, str(status)).inc()

    def render(self, stats: Stats) -> bytes:
        name = self.model_name
        self.running.labels(name).set(stats.running)
        self.waiting.labels(name).set(stats.waiting)
        self.kv_usage.labels(name).set(stats.kv_usage)
        self.kv_pages_used.labels(name).set(stats.kv_pages_used)
        # The scheduler keeps running totals; counters only go up by the difference.
        q, h = self._prefix_seen
        self.prefix_cache_queries.labels(name).inc(max(0, stats.prefix_queries - q))
        self.prefix_cache_hits.labels(name).inc(max(0, stats.prefix_hits - h))
        self._prefix_seen = (max(q, stats.prefix_queries), max(h, stats.prefix_hits))
        return generate_latest(self.registry)
