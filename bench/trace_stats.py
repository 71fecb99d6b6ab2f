"""How much prefill work a prefix cache could save on the Mooncake traces.

    python bench/trace_stats.py [--rate 5.5] [--num 1000]

Mooncake traces name each prompt's 512-token blocks by hash (``hash_ids``): equal ids are
equal token blocks. A request's *reusable prefix* is its leading run of blocks that some
earlier request already sent, which an unbounded prefix cache (vLLM's automatic prefix
caching, SGLang's radix cache) would not prefill again
(``conflux_jax.bench.workloads.cached_prefixes``; ``sim --prefix-cache`` applies it).
Printed per trace: the share of prompt tokens in such prefixes, and the prefill compute
a workload needs on raw prompts at ``--rate`` for Qwen3-14B (linear layers plus causal
attention), against the bf16 dense peak of 4 H100s: what the simulator prices without
``--prefix-cache``.
"""

from __future__ import annotations

import argparse

from conflux_jax.bench.workloads import at_rate, cached_prefixes, load_trace, load_trace_hashes
from conflux_jax.latency.roofline import HARDWARE, MODELS


def prefill_pflops(name: str, rate: float, num: int, model: str = "qwen3-14b") -> float:
    """PFLOP/s the raw prompts of ``num`` requests rescaled to ``rate`` req/s need."""
    shape = MODELS[model]
    reqs = at_rate(load_trace(name), rate, num, shape.max_context)
    q_dim = shape.num_q_heads * shape.head_dim
    per_token = 2 * shape.params_per_layer * shape.num_layers  # LM head: last token only
    attention = 4 * shape.num_layers * q_dim  # QK^T and PV, times sum of p^2 / 2 (causal)
    flops = sum(per_token * r.prompt_len + attention * r.prompt_len ** 2 / 2 for r in reqs)
    return flops / reqs[-1].arrival_s / 1e15


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=5.5)
    ap.add_argument("--num", type=int, default=1000)
    args = ap.parse_args(argv)
    peak = 4 * HARDWARE["h100"].peak_flops / 1e15
    for name in ("conversation", "synthetic"):
        prompts = [p for _, p, _ in load_trace(name)]
        share = sum(cached_prefixes(load_trace_hashes(name), prompts)) / sum(prompts)
        need = prefill_pflops(name, args.rate, args.num)
        print(f"{name}: {len(prompts)} requests, reusable prefix {share:.1%}"
              f" of prompt tokens; raw prefill at {args.rate} req/s ({args.num} sampled): "
              f"{need:.2f} PFLOP/s = {need / peak:.0%} of 4 H100s' bf16 dense peak")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
