"""Times the pallas_kernels ops on the current backend.

    python -m conflux_jax.bench kernels [--json PATH] [--budget-s S] [--no-sweep]

On GPU: ceilings measured in the same run (a large device-to-device copy, a large bf16 matmul),
then decode (64 sequences x 8K context, bf16) as achieved HBM GB/s against the copy bandwidth
and prefill (an 8K-token chunk over 8K of history) as TFLOP/s against the matmul rate, for the
default tiling and a small sweep of alternatives (targets: decode >= 70% of copy, prefill >=
40% of matmul). On CPU: jnp XLA path vs Pallas interpret timings at small sizes, and on
decode shapes the CPU's FFI handler (``pallas_kernels.cpu_attention``) beside them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import BlockSizes, default_block_sizes, ragged_paged_attention, write_kv
from pallas_kernels.cpu_attention import (
    paged_attention_available,
    paged_decode,
    paged_prefill,
)
from pallas_kernels.cpu_gemm import pack_weight, packed_gemm_available, packed_matmul

DECODE_TARGET = 0.70  # of measured copy bandwidth
PREFILL_TARGET = 0.40  # of measured bf16 matmul rate


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention workload: live sequences with their query and total KV lengths."""

    name: str
    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: Any

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    def kv_bytes(self) -> int:
        """HBM bytes a perfect kernel reads: each live K/V row once, plus q and the output."""
        item = jnp.dtype(self.dtype).itemsize
        kv = 2 * sum(self.kv_lens) * self.num_kv_heads * self.head_dim * item
        return kv + 2 * self.num_tokens * self.num_q_heads * self.head_dim * item

    def flops(self) -> int:
        """Causal attention FLOPs (QK^T and PV), counting only visible (query, key) pairs."""
        pairs = 0
        for q_len, kv_len in zip(self.q_lens, self.kv_lens, strict=True):
            hist = kv_len - q_len
            pairs += q_len * hist + q_len * (q_len + 1) // 2
        return 4 * pairs * self.num_q_heads * self.head_dim


def make_inputs(shape: Shape, seed: int = 0) -> tuple[Any, ...]:
    """Random inputs on the default device; pages of all sequences randomly interleaved."""
    s = len(shape.q_lens)
    pages_per_seq = max(math.ceil(k / shape.page_size) for k in shape.kv_lens)
    num_pages = s * pages_per_seq
    kq, kk, kv, kp = jax.random.split(jax.random.key(seed), 4)
    pool = (num_pages, shape.page_size, shape.num_kv_heads, shape.head_dim)
    q = jax.random.normal(kq, (shape.num_tokens, shape.num_q_heads, shape.head_dim), shape.dtype)
    k_pages = jax.random.normal(kk, pool, shape.dtype)
    v_pages = jax.random.normal(kv, pool, shape.dtype)
    page_indices = jax.random.permutation(kp, num_pages).reshape(s, pages_per_seq)
    cu = np.concatenate([[0], np.cumsum(shape.q_lens)]).astype(np.int32)
    return (
        q,
        k_pages,
        v_pages,
        jnp.asarray(shape.kv_lens, jnp.int32),
        page_indices.astype(jnp.int32),
        jnp.asarray(cu),
        jnp.int32(s),
    )


def time_call(fn: Callable[..., Any], args: Sequence[Any], iters: int) -> dict[str, float]:
    """Compile + first run, then ``iters`` timed runs; milliseconds."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    first = time.perf_counter() - t0
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return {
        "compile_and_first_ms": 1e3 * first,
        "median_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
    }


def attention_fn(impl: str, bs: BlockSizes | None = None) -> Callable[..., Any]:
    kw = dataclasses.asdict(bs) if bs is not None else {}
    return jax.jit(lambda *a: ragged_paged_attention(*a, impl=impl, **kw))


def write_kv_fn(impl: str) -> Callable[..., Any]:
    return jax.jit(lambda *a: write_kv(*a, impl=impl), donate_argnums=(0, 1))


# --------------------------------------------------------------------------------------------
# GPU
# --------------------------------------------------------------------------------------------


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> dict[str, float]:
    x = jnp.ones((nbytes // 4,), jnp.float32)
    t = time_call(jax.jit(lambda a: a.copy()), (x,), iters=20)
    del x
    return {"bytes": nbytes, **t, "gb_per_s": 2 * nbytes / (t["min_ms"] * 1e-3) / 1e9}


def matmul_tflops(n: int = 8192) -> dict[str, float]:
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, n), jnp.bfloat16)
    t = time_call(jax.jit(jnp.matmul), (a, b), iters=20)
    return {"n": n, **t, "tflop_per_s": 2 * n**3 / (t["min_ms"] * 1e-3) / 1e12}


def sweep(
    shape: Shape,
    candidates: Sequence[BlockSizes],
    metric: Callable[[float], float],
    iters: int,
    deadline: float,
    impl: str = "pallas",
) -> list[dict[str, Any]]:
    """Times the kernel under each tiling (the default first) until ``deadline``."""
    args = make_inputs(shape)
    ref = None
    rows = []
    for bs in candidates:
        if time.monotonic() > deadline and rows:
            break
        row: dict[str, Any] = {"block_sizes": dataclasses.asdict(bs)}
        try:
            fn = attention_fn(impl, bs)
            row.update(time_call(fn, args, iters))
            row["metric"] = metric(row["min_ms"])
            out = np.asarray(fn(*args).astype(jnp.float32))
            ref = out if ref is None else ref
            row["max_abs_diff_vs_default"] = float(np.abs(out - ref).max())
            row["finite"] = bool(np.isfinite(out).all())
        except Exception as e:  # a tiling Triton rejects must not end the sweep
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        print(f"  {shape.name} {row}", flush=True)
    return rows


def jnp_path_row(shape: Shape, metric: Callable[[float], float], iters: int) -> dict[str, Any]:
    """The op's jnp path (``impl="xla"``) on the same inputs: the kernel's baseline."""
    row: dict[str, Any] = {"impl": "xla"}
    try:
        row.update(time_call(attention_fn("xla"), make_inputs(shape), iters))
        row["metric"] = metric(row["min_ms"])
    except Exception as e:  # e.g. out of memory on a long prefill: reported, not fatal
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
    print(f"  {shape.name} {row}", flush=True)
    return row


def _best(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in rows if "metric" in r and r.get("finite")]
    return max(ok, key=lambda r: r["metric"]) if ok else None


def bench_gpu(
    budget_s: float, do_sweep: bool, page_size: int, dry_run: bool = False
) -> dict[str, Any]:
    """GPU figures. ``dry_run``: the same code path at toy sizes in interpret mode (any host)."""
    start = time.monotonic()
    impl = "interpret" if dry_run else "pallas"
    copy = copy_bandwidth_gbs(64 << 20 if dry_run else 4 << 30)
    mm = matmul_tflops(512 if dry_run else 8192)
    print(
        f"ceilings: copy {copy['gb_per_s']:.0f} GB/s, bf16 matmul {mm['tflop_per_s']:.0f} TFLOP/s",
        flush=True,
    )
    # Llama-3-8B-like heads (GQA 4); the dry run keeps the group size so the sweep applies.
    hq, hkv, d = (8, 2, 64) if dry_run else (32, 8, 128)
    heads = dict(num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size)
    n_seq, ctx, chunk = (8, 512, 64) if dry_run else (64, 8192, 8192)
    decode = Shape("decode", (1,) * n_seq, (ctx,) * n_seq, dtype=jnp.bfloat16, **heads)
    prefill = Shape("prefill", (chunk,), (2 * chunk,), dtype=jnp.bfloat16, **heads)
    d_cands = [default_block_sizes(n_seq, n_seq, hq, hkv, d)]
    p_cands = [default_block_sizes(chunk, 1, hq, hkv, d)]
    if do_sweep:
        d_cands += [
            BlockSizes(4, 128, 1, 4, 3),
            BlockSizes(4, 64, 2, 4, 3),
            BlockSizes(4, 32, 1, 4, 4),
            BlockSizes(4, 64, 1, 4, 2),
            BlockSizes(4, 64, 1, 4, 3),  # the default before the first GPU run
            BlockSizes(4, 64, 4, 4, 3),
            BlockSizes(8, 64, 1, 4, 3),
        ]
        p_cands += [
            BlockSizes(32, 64, 1, 8, 3),
            BlockSizes(32, 128, 1, 8, 2),
            BlockSizes(16, 64, 1, 4, 3),
            BlockSizes(16, 128, 1, 4, 2),
            BlockSizes(32, 32, 1, 4, 3),
            BlockSizes(32, 64, 1, 8, 2),  # the default before the second GPU run
            BlockSizes(32, 64, 1, 4, 3),
        ]
    half = start + budget_s / 2
    gbs = lambda ms: decode.kv_bytes() / (ms * 1e-3) / 1e9
    d_rows = sweep(decode, d_cands, gbs, iters=3 if dry_run else 30, deadline=half, impl=impl)
    tflops = lambda ms: prefill.flops() / (ms * 1e-3) / 1e12
    p_rows = sweep(
        prefill, p_cands, tflops, iters=3 if dry_run else 10, deadline=start + budget_s, impl=impl
    )

    result: dict[str, Any] = {"copy": copy, "matmul": mm}
    for name, rows, ceiling, target, unit, shape, metric in (
        ("decode", d_rows, copy["gb_per_s"], DECODE_TARGET, "GB/s", decode, gbs),
        ("prefill", p_rows, mm["tflop_per_s"], PREFILL_TARGET, "TFLOP/s", prefill, tflops),
    ):
        best = _best(rows)
        default = rows[0] if "metric" in rows[0] else None
        entry = {
            "unit": unit,
            "ceiling": ceiling,
            "target_fraction": target,
            "default": default,
            "best": best,
            "default_fraction": default["metric"] / ceiling if default else None,
            "best_fraction": best["metric"] / ceiling if best else None,
            "meets_target_default": bool(default and default["metric"] >= target * ceiling),
            "meets_target_best": bool(best and best["metric"] >= target * ceiling),
            "sweep": rows,
        }
        # The baseline beside the kernel: the same op through the jnp path, compiled by XLA.
        entry["xla"] = jnp_path_row(shape, metric, iters=3 if dry_run else 10)
        result[name] = entry
        d_txt = f"{default['metric']:.1f}" if default else "failed"
        b_txt = f"{best['metric']:.1f} with {best['block_sizes']}" if best else "failed"
        x_txt = f"{entry['xla']['metric']:.1f}" if "metric" in entry["xla"] else "failed"
        print(
            f"{name}: default {d_txt} {unit}, best {b_txt} {unit}; jnp path {x_txt} {unit}; "
            f"ceiling {ceiling:.1f}; target {target:.0%} -> default "
            f"{entry['meets_target_default']}, best {entry['meets_target_best']}",
            flush=True,
        )
    result["write_kv"] = bench_write_kv(
        ["xla", impl], num_tokens=64 if dry_run else 8192, iters=3 if dry_run else 20
    )
    result["shapes"] = {
        s.name: {
            **dataclasses.asdict(s),
            "dtype": jnp.dtype(s.dtype).name,
            "q_lens": f"{len(s.q_lens)} x {s.q_lens[0]}",
            "kv_lens": f"{len(s.kv_lens)} x {s.kv_lens[0]}",
        }
        for s in (decode, prefill)
    }
    return result


# --------------------------------------------------------------------------------------------
# CPU (and any backend): XLA path vs Pallas interpret at small sizes
# --------------------------------------------------------------------------------------------


def bench_write_kv(impls: Sequence[str], num_tokens: int, iters: int) -> dict[str, Any]:
    num_pages, page_size, hkv, d = 2 * num_tokens // 16, 16, 8, 128
    out = {}
    for impl in impls:
        k = jnp.zeros((num_pages, page_size, hkv, d), jnp.bfloat16)
        v = jnp.zeros_like(k)
        new = jnp.ones((num_tokens, hkv, d), jnp.bfloat16)
        slots = jax.random.permutation(jax.random.key(2), num_pages * page_size)[:num_tokens]
        fn = write_kv_fn(impl)
        # Donated pools: thread them through so every call updates in place.
        k, v = fn(k, v, new, new, slots)
        jax.block_until_ready(k)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            k, v = fn(k, v, new, new, slots)
            jax.block_until_ready(k)
            times.append(time.perf_counter() - t0)
        moved = 2 * 2 * num_tokens * hkv * d * 2  # read new + write slot, K and V, bf16
        ms = 1e3 * min(times)
        out[impl] = {"min_ms": ms, "gb_per_s": moved / (ms * 1e-3) / 1e9, "tokens": num_tokens}
        print(f"write_kv {impl}: {ms:.3f} ms ({out[impl]['gb_per_s']:.1f} GB/s)", flush=True)
    return out


def bench_small(iters: int) -> dict[str, Any]:
    """Reference vs interpret on shapes of the 135M model (9 q heads, 3 KV heads, d=64)."""
    heads = dict(num_q_heads=9, num_kv_heads=3, head_dim=64, page_size=16, dtype=jnp.float32)
    shapes = [
        Shape("decode", (1,) * 16, (1024,) * 16, **heads),
        # 16 CPU serving streams mid-run: short, unequal contexts.
        Shape("decode-150", (1,) * 16, tuple(110 + 5 * i for i in range(16)), **heads),
        Shape("prefill", (256,), (512,), **heads),
        Shape("mixed", (128,) + (1,) * 15, (384,) + (700,) * 15, **heads),
    ]
    result: dict[str, Any] = {}
    for shape in shapes:
        args = make_inputs(shape)
        row: dict[str, Any] = {}
        outs = {}
        for impl in ("xla", "interpret"):
            t = time_call(attention_fn(impl), args, iters)
            t["gflop_per_s"] = shape.flops() / (t["min_ms"] * 1e-3) / 1e9
            t["gb_per_s"] = shape.kv_bytes() / (t["min_ms"] * 1e-3) / 1e9
            row[impl] = t
            outs[impl] = np.asarray(attention_fn(impl)(*args))
        row["max_abs_diff"] = float(np.abs(outs["xla"] - outs["interpret"]).max())
        cpu = ""
        if paged_attention_available()[0]:  # the CPU's handlers, as the step picks them
            fn = jax.jit(paged_prefill if set(shape.q_lens) != {1} else (
                lambda q, k, v, lens, pages, cu, n: paged_decode(q, k, v, lens, pages, n)))
            row["cpu_handler"] = time_call(fn, args, iters)
            row["cpu_handler_max_abs_diff"] = float(np.abs(np.asarray(fn(*args))
                                                           - outs["xla"]).max())
            cpu = (f", CPU handler {row['cpu_handler']['min_ms']:6.2f} ms "
                   f"(xla/handler {row['xla']['min_ms'] / row['cpu_handler']['min_ms']:.2f}x)")
        result[shape.name] = row
        print(
            f"{shape.name:10s} T={shape.num_tokens:4d} S={len(shape.q_lens):2d}: xla "
            f"{row['xla']['min_ms']:8.2f} ms, interpret {row['interpret']['min_ms']:8.2f} "
            f"ms, max |diff| {row['max_abs_diff']:.2e}{cpu}",
            flush=True,
        )
    result["write_kv"] = bench_write_kv(["xla", "interpret"], num_tokens=64, iters=iters)
    return result


# SmolLM2-135M's layer matrices, (name, K, N): wqkv as the packed decoder runs Q, K and V
# (fused, see models.params.FUSED_LINEARS), the others as every route runs them.
GEMM_SHAPES = (("wqkv", 576, 960), ("wq/wo", 576, 576), ("wk/wv", 576, 192),
               ("gate/up", 576, 1536), ("down", 1536, 576))


def bench_gemm(iters: int, rows: Sequence[int] = (1, 16, 64, 256), layers: int = 30,
               vocab: int = 49152) -> dict[str, Any]:
    """The packed GEMM vs XLA's dot on SmolLM2's matrices, as the decoder runs them: the
    layer matrices stacked over ``layers`` and indexed by a traced layer (a different one
    each call, so the weights stream from memory as in a step), and the tied LM head."""
    if not packed_gemm_available()[0]:
        print(f"packed GEMM: unavailable ({packed_gemm_available()[1]})", flush=True)
        return {}
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {}
    mats = [(name, k, n, layers) for name, k, n in GEMM_SHAPES] + [("lm_head", 576, vocab, 1)]
    for name, k, n, depth in mats:
        plain = rng.standard_normal((depth, k, n), dtype=np.float32)
        packed = jnp.asarray(pack_weight(plain))
        plain_dev = jnp.asarray(plain)
        del plain
        routes = {
            "packed": jax.jit(lambda x, w, layer, n=n: packed_matmul(x, w, layer, n)),
            # The tied head as the model multiplies it: x @ embed.T, nothing indexed.
            "xla": jax.jit((lambda x, w, layer: x @ w.T) if name == "lm_head"
                           else (lambda x, w, layer: x @ w[layer])),
        }
        weights = {"packed": packed,
                   "xla": jnp.asarray(plain_dev[0].T) if name == "lm_head" else plain_dev}
        for m in rows:
            x = jnp.asarray(rng.standard_normal((m, k), dtype=np.float32))
            row: dict[str, Any] = {}
            for route, fn in routes.items():
                layer_ids = [jnp.int32(i % depth) for i in range(iters + 1)]
                jax.block_until_ready(fn(x, weights[route], layer_ids[0]))
                times = []
                for layer in layer_ids[1:]:
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(x, weights[route], layer))
                    times.append(time.perf_counter() - t0)
                best = min(times)
                row[route] = {"min_ms": 1e3 * best, "gb_per_s": k * n * 4 / best / 1e9,
                              "gflop_per_s": 2 * m * k * n / best / 1e9}
            diff = np.abs(np.asarray(routes["packed"](x, packed, jnp.int32(0)))
                          - np.asarray(routes["xla"](x, weights["xla"], jnp.int32(0)))).max()
            row["max_abs_diff"] = float(diff)
            row["xla_over_packed"] = row["xla"]["min_ms"] / row["packed"]["min_ms"]
            result[f"{name} {m}x{k}x{n}"] = row
            print(f"gemm {name:8s} M={m:3d} K={k:4d} N={n:5d}: packed "
                  f"{row['packed']['min_ms']:7.3f} ms ({row['packed']['gflop_per_s']:4.0f} "
                  f"GFLOP/s, {row['packed']['gb_per_s']:3.0f} GB/s), XLA's dot "
                  f"{row['xla']['min_ms']:7.3f} ms: {row['xla_over_packed']:.2f}x, max |diff| "
                  f"{diff:.1e}", flush=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conflux_jax.bench kernels",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--budget-s", type=float, default=240.0, help="GPU sweep time budget")
    parser.add_argument("--no-sweep", action="store_true", help="GPU: default tiling only")
    parser.add_argument("--page-size", type=int, default=16, help="GPU: KV page size")
    parser.add_argument("--iters", type=int, default=5, help="CPU: timed runs per op")
    parser.add_argument(
        "--gpu-dry-run",
        action="store_true",
        help="run the GPU code path at toy sizes in interpret mode (to check it off-GPU)",
    )
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    print(f"backend {backend}: {jax.devices()[0].device_kind}", flush=True)
    report: dict[str, Any] = {
        "backend": backend,
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "impl_env": os.environ.get("CONFLUX_ATTENTION_IMPL"),
    }
    if backend == "gpu" or args.gpu_dry_run:
        report["dry_run"] = args.gpu_dry_run
        report.update(
            bench_gpu(args.budget_s, not args.no_sweep, args.page_size, dry_run=args.gpu_dry_run)
        )
    else:
        report.update(bench_small(args.iters))
        report["gemm"] = bench_gemm(max(args.iters, 20))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
