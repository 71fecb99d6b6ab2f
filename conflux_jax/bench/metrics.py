"""Serving metrics in vLLM's ``bench serve`` conventions plus the paper's deadline metric.

TTFT = send to first non-empty token; TPOT = (latency - TTFT) / (output tokens - 1);
ITL = every gap between streamed tokens; E2EL = send to last token (SIMULATOR.md,
"Benchmark output conventions"). ``deadline_attainment``: the share of requests whose
i-th token (1-based) arrived by ``send + TTFT_SLO + (i - 1) * TBT_SLO`` (§8.1); failed
requests count as late.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from conflux_jax import slo

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class RequestResult:
    """One request as the client saw it; times are seconds on one monotonic clock."""

    send_s: float
    input_len: int
    token_times: list[float] = dataclasses.field(default_factory=list)
    output_len: int = 0  # tokens generated (server usage when known, else streamed tokens)
    success: bool = False
    error: str = ""
    cached_tokens: int = 0  # prompt tokens the server's prefix cache served
    output_ids: list[int] = dataclasses.field(default_factory=list)  # multi-turn replays
    prompt_ids: list[int] = dataclasses.field(default_factory=list)  # what was sent

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send_s if self.token_times else None

    @property
    def latency(self) -> float | None:
        return self.token_times[-1] - self.send_s if self.token_times else None

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def meets_deadlines(self, ttft_slo_s: float, tbt_slo_s: float) -> bool:
        if not self.success or not self.token_times:
            return False
        return slo.all_on_time(self.token_times, self.send_s, ttft_slo_s, tbt_slo_s)


def _stats(name: str, values_s: list[float]) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=float) * 1e3
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def summarize(results: list[RequestResult], duration_s: float, ttft_slo_s: float,
              tbt_slo_s: float) -> dict:
    """vLLM's saved-JSON keys plus ``deadline_attainment`` and the SLOs used."""
    ok = [r for r in results if r.success]
    total_in = sum(r.input_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok
             if r.output_len > 1 and r.latency is not None and r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    e2els = [r.latency for r in ok if r.latency is not None]
    good = sum(r.meets_deadlines(ttft_slo_s, tbt_slo_s) for r in results)
    dur = max(duration_s, 1e-9)
    out = {
        "duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur, "request_goodput": good / dur,
        "output_throughput": total_out / dur, "total_token_throughput": (total_in + total_out)
        / dur,
        "deadline_attainment": good / max(1, len(results)),
        "total_cached_tokens": cached, "prefix_cache_hit_rate": cached / max(1, total_in),
        "ttft_slo_s": ttft_slo_s, "tbt_slo_s": tbt_slo_s,
    }
    for name, vals in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        out.update(_stats(name, vals))
    out.update({"input_lens": [r.input_len for r in results],
                "output_lens": [r.output_len for r in results],
                "ttfts": [r.ttft for r in results], "itls": [r.itls for r in results],
                "errors": [r.error for r in results]})
    return out


def format_summary(m: dict, title: str = "Serving Benchmark Result",
                   extra: dict[str, str] | None = None) -> str:
    """vLLM ``bench serve`` console layout (its section rules and label column)."""
    w = 50

    def row(label: str, value: object, fmt: str = "") -> str:
        v = format(value, fmt) if fmt else str(value)
        return f"{label:<40}{v:<10}"

    def rule(text: str, fill: str = "-") -> str:
        return f"{text:{fill}^{w}}"

    lines = [rule(f" {title} ", "="),
             row("Successful requests:", m["completed"]),
             row("Failed requests:", m["failed"]),
             row("Benchmark duration (s):", m["duration"], ".2f"),
             row("Total input tokens:", m["total_input_tokens"]),
             row("Total generated tokens:", m["total_output_tokens"]),
             row("Request throughput (req/s):", m["request_throughput"], ".2f"),
             row("Request goodput (req/s):", m["request_goodput"], ".2f"),
             row("Output token throughput (tok/s):", m["output_throughput"], ".2f"),
             row("Total Token throughput (tok/s):", m["total_token_throughput"], ".2f"),
             row(f"Deadline attainment ({m['ttft_slo_s']:g}s/{m['tbt_slo_s'] * 1e3:g}ms):",
                 f"{100 * m['deadline_attainment']:.1f}%"),
             row("Prefix cache hit rate (tokens):",
                 f"{100 * m.get('prefix_cache_hit_rate', 0.0):.1f}%")]
    for key, name, header in (("ttft", "TTFT", "Time to First Token"),
                              ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
                              ("itl", "ITL", "Inter-token Latency"),
                              ("e2el", "E2EL", "End-to-end Latency")):
        lines.append(rule(header))
        lines.append(row(f"Mean {name} (ms):", m[f"mean_{key}_ms"], ".2f"))
        lines.append(row(f"Median {name} (ms):", m[f"median_{key}_ms"], ".2f"))
        lines.append(row(f"P99 {name} (ms):", m[f"p99_{key}_ms"], ".2f"))
    for label, value in (extra or {}).items():
        lines.append(row(label, value))
    lines.append("=" * w)
    return "\n".join(lines)
