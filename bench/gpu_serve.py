"""Step correctness and a short serve benchmark on the device, for ``bench/gpu_check.sh``.

Downloads nothing and installs nothing:

1. ``step``: the whole Conflux step on this device (the compiled attention kernel the
   backend selects, inside the engine) against the dense single-device reference, on a
   tiny random Llama in float32 (greedy tokens equal) and bfloat16 (greedy tokens equal to
   the bf16 dense forward's, log-probabilities within 0.1).
2. ``serve``: random-initialised Llama-3.1-8B-shaped weights in bf16, made on the device;
   the engine with ``dtype=auto`` and the KV pool sized by ``--gpu-memory-utilization``;
   warm-up (compile, then calibrate the latency model); one offline batch of random
   prompts; throughput, TTFT / TBT percentiles and the decode step against its
   weight-read floor.

Writes one JSON (``--json``).  ``python bench/gpu_serve.py --stage step`` runs on CPU too.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

# A stand-in with the same code path, to smoke-test the serve stage on CPU (--shape tiny).
TINY = dict(architecture="llama", vocab_size=512, hidden_size=128, intermediate_size=256,
            num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, rope_theta=500000.0,
            max_position_embeddings=4096, tie_word_embeddings=False, eos_token_ids=(2,))
LLAMA_8B = dict(architecture="llama", vocab_size=128256, hidden_size=4096,
                intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                head_dim=128, rope_theta=500000.0, max_position_embeddings=131072,
                tie_word_embeddings=False, eos_token_ids=(128001,))


def word_tokenizer(vocab: int) -> Any:
    """Token i <-> word "w{i}": random-weight models need no real tokenizer."""
    from conflux_jax.tokenizer import Tokenizer

    return Tokenizer.word_level(vocab)


def step_check() -> dict[str, Any]:
    """Greedy tokens (and bf16 log-probabilities) of the engine vs the dense reference."""
    import jax

    from conflux_jax import SamplingParams, reference
    from conflux_jax.config import ModelConfig
    from conflux_jax.engine import Engine, EngineConfig
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig
    from conflux_jax.models.decoder import random_params

    cfg = ModelConfig(architecture="llama", vocab_size=512, hidden_size=128,
                      intermediate_size=256, num_layers=2, num_heads=8, num_kv_heads=2,
                      head_dim=16, max_position_embeddings=512, eos_token_ids=(2,))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, int(n)).tolist() for n in (7, 40, 100, 190)]
    n_new = 12
    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16"):
        params = random_params(cfg, seed=1, scale=0.3)
        ec = ExecutorConfig(mesh="sp=1,tp=1", page_size=16, num_pages=256,
                            max_model_len=256, dtype=dtype,
                            buckets=BucketConfig(tokens=(16, 256), decode=(16,),
                                                 transfer=(16,), max_prefill_seqs=4))
        # float32 is compared at float32 precision (no TF32 anywhere, as the CPU tests
        # run); bfloat16 runs the engine's accelerator defaults.
        precision = "highest" if dtype == "float32" else None
        with jax.default_matmul_precision(precision):
            engine = Engine(cfg, params, word_tokenizer(cfg.vocab_size),
                            EngineConfig(executor=ec, calibrate=False))
            got = engine.generate(prompts, [SamplingParams(
                max_tokens=n_new, temperature=0, logprobs=5, ignore_eos=True)] * 4)
            ref_params = jax.tree.map(lambda a, dt=dtype: jax.numpy.asarray(a, dt), params)
            logits_all = [np.asarray(reference.forward(
                cfg, ref_params, (p + o.outputs[0].token_ids + [0] * 256)[:256]), np.float32)
                for p, o in zip(prompts, got, strict=True)]
        # The reference runs on the engine's own tokens (teacher forcing), so every
        # position is judged on its own: the engine's pick must be the reference's argmax,
        # or (bf16) a near-tie with it, within the log-probability tolerance.
        tol = 1e-3 if dtype == "float32" else 0.1
        wrong, ties, worst = 0, 0, 0.0
        for prompt, o, logits in zip(prompts, got, logits_all, strict=True):
            toks = o.outputs[0].token_ids
            lp = np.asarray(jax.nn.log_softmax(logits[len(prompt) - 1:len(prompt) + n_new - 1]))
            gap = lp.max(-1) - lp[np.arange(len(toks)), toks]
            wrong += int(np.sum(gap > tol))
            ties += int(np.sum((gap > 0) & (gap <= tol)))
            for i, top in enumerate(o.outputs[0].logprobs):
                ids = list(top)
                worst = max(worst, float(np.max(np.abs(np.array([top[t] for t in ids])
                                                       - lp[i, ids]))))
        out[dtype] = {"tokens_wrong": wrong, "near_tie_picks": ties, "max_logprob_err": worst,
                      "tolerance": tol, "ok": wrong == 0 and worst <= tol,
                      "attention_impl": _impl(), "device": jax.devices()[0].device_kind}
    return out


def _impl() -> str:
    from pallas_kernels._common import resolve_impl

    return resolve_impl(None)


def random_device_params(config: Any, seed: int = 0) -> Any:
    """Random bf16 weights made on the device (no host copy of 16 GB): norms near 1."""
    import jax
    import jax.numpy as jnp

    from conflux_jax.models.params import param_shapes

    key = jax.random.key(seed)
    leaves, tree = jax.tree.flatten(param_shapes(config),
                                    is_leaf=lambda x: isinstance(x, tuple))
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(
        param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))[0]]

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def make(k: jax.Array, shape: tuple[int, ...], norm: bool) -> jax.Array:
        x = jax.random.normal(k, shape, jnp.bfloat16)
        return (1 + 0.1 * x) if norm else x * jnp.bfloat16(0.02)

    arrays = [make(jax.random.fold_in(key, i), tuple(shape), "norm" in str(path[-1]))
              for i, (path, shape) in enumerate(zip(paths, leaves, strict=True))]
    return jax.tree.unflatten(tree, arrays)


def serve_bench(args: argparse.Namespace, report: Any) -> dict[str, Any]:
    """Runs the serve benchmark; ``report(part)`` is called with each finished part, so a
    stage cut by its time limit still leaves what it measured."""
    import jax

    from conflux_jax import SamplingParams
    from conflux_jax.bench.replay import captured_batches, device_seconds
    from conflux_jax.config import ModelConfig, RopeScaling
    from conflux_jax.engine import Engine, EngineConfig
    from conflux_jax.engine.calibration import Budget
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig
    from conflux_jax.latency.roofline import hardware_for_device_kind

    shape = LLAMA_8B if args.shape == "llama3.1-8b" else TINY
    cfg = ModelConfig(**shape, rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192))
    t0 = time.perf_counter()
    params = random_device_params(cfg)
    jax.block_until_ready(params)
    init_s = time.perf_counter() - t0
    groups = -(-args.max_model_len // 16)
    # Few buckets: an 8B step takes tens of seconds to compile, and the check has minutes.
    buckets = BucketConfig(tokens=(64, 512), decode=(64,), transfer=(groups,),
                           max_prefill_seqs=8)
    ec = ExecutorConfig(mesh="sp=1,tp=1", max_model_len=args.max_model_len, buckets=buckets,
                        gpu_memory_utilization=args.gpu_memory_utilization)
    t0 = time.perf_counter()
    engine = Engine(cfg, params, word_tokenizer(cfg.vocab_size), EngineConfig(
        executor=ec, ttft_slo_s=args.ttft_slo, tbt_slo_s=args.tbt_slo,
        profile=f"{args.shape}-random", recalibrate=True, calibrate=True,
        calibration_budget=Budget(num_train=24, num_test=16, repeats=2)))
    del params  # the executor holds its own (donated to nothing, so the same buffers)
    build_s = time.perf_counter() - t0
    estimate = engine.latency_model.meta.get("source", "built-in")
    ex, mp = engine.executor, engine.executor.memory
    memory = {"num_pages": mp.num_pages, "kv_tokens": mp.num_pages * ec.page_size,
              "device_gib": mp.device_bytes / 2**30, "budget_gib": mp.budget_bytes / 2**30,
              "weights_gib": mp.weight_bytes / 2**30,
              "activations_gib": mp.activation_bytes / 2**30,
              "largest_shape": str(mp.largest_shape)}
    report({"device": ex.device_kind, "dtype": ex.dtype.name, "attention_impl": _impl(),
            "init_s": init_s, "engine_build_s": build_s, "memory": memory})
    warm_s = engine.warmup(progress=False)
    engine.executor.guard.serving = True
    report({"warmup_s": warm_s, "shapes_compiled": len(ex._compiled),
            "latency_model": {"before_warmup": estimate,
                              "source": engine.latency_model.meta.get("source"),
                              "heldout_mape_pct": engine.latency_model.meta.get(
                                  "heldout_mape_pct")}})

    rng = np.random.default_rng(0)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, args.num_prompts)
    prompts = [rng.integers(3, cfg.vocab_size, int(n)).tolist() for n in lens]
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, [sp] * len(prompts))
    wall = time.perf_counter() - t0
    ttft = [o.metrics["first_token_s"] - o.metrics["arrival_s"] for o in outs]
    tbt = [b - a for o in outs for a, b in zip(o.metrics["token_times_s"],
                                              o.metrics["token_times_s"][1:], strict=False)]
    pct = (lambda xs, q: float(np.percentile(xs, q)) if xs else None)
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    report({"serve": {"requests": len(outs), "prompt_tokens": int(lens.sum()),
                      "output_tokens": out_tokens, "wall_s": wall,
                      "output_tok_s": out_tokens / wall,
                      "total_tok_s": (out_tokens + int(lens.sum())) / wall,
                      "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
                      "tbt_p50_s": pct(tbt, 50), "tbt_p99_s": pct(tbt, 99)}})
    # One decode-only step at the decode bucket: against reading the weights once, and
    # its device part alone (the same compiled step replayed on inputs already there).
    decode_prompts = [rng.integers(3, cfg.vocab_size, 32).tolist() for _ in range(64)]
    t0 = time.perf_counter()
    with captured_batches(ex, lambda plan: not plan.prefill and len(plan.decode) == 64) \
            as kept:
        dec = engine.generate(decode_prompts, [SamplingParams(
            max_tokens=24, temperature=0, ignore_eos=True)] * 64)
    wall = time.perf_counter() - t0
    steps = [b - a for o in dec for a, b in zip(o.metrics["token_times_s"][8:],
                                               o.metrics["token_times_s"][9:], strict=False)]
    hw = hardware_for_device_kind(ex.device_kind)
    floor = mp.weight_bytes / hw.hbm_bw if hw else None
    step_p50 = pct(steps, 50)
    device_s = device_seconds(engine, *kept[-1], repeats=20) if kept else None
    return {"decode_64": {"step_p50_s": step_p50, "device_step_s": device_s,
                          "host_share": 1 - device_s / step_p50 if device_s and step_p50
                          else None,
                          "weight_read_floor_s": floor,
                          "floor_share": floor / step_p50 if floor and step_p50 else None,
                          "tokens_s": 64 / step_p50 if step_p50 else None,
                          "wall_s": wall}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stage", choices=["step", "serve", "all"], default="all")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--shape", choices=["llama3.1-8b", "tiny"], default="llama3.1-8b",
                    help="weights' shape (tiny: a CPU smoke test of the same path)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=128)
    ap.add_argument("--max-prompt", type=int, default=2048)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ttft-slo", type=float, default=2.0)
    ap.add_argument("--tbt-slo", type=float, default=0.05)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("jax", "absl"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    result: dict[str, Any] = {}
    ok = True
    if args.stage in ("step", "all"):
        result["step"] = step_check()
        ok = all(v["ok"] for v in result["step"].values())
        print("step:", json.dumps(result["step"]), flush=True)
        args.json.write_text(json.dumps(result, indent=2))
    if args.stage in ("serve", "all"):
        result["serve"] = {}

        def report(part: dict[str, Any]) -> None:
            result["serve"].update(part)
            print("serve:", json.dumps(part), flush=True)
            args.json.write_text(json.dumps(result, indent=2))

        report(serve_bench(args, report))
    args.json.write_text(json.dumps(result, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
