"""Single-stream decode speed of the default model: ours vs HF transformers, same run.

    python bench/decode_cpu.py [--tokens 64] [--json PATH]

Prints ms/token for our dense reference path, for the engine (scheduler + Conflux
executor on one rank) and for transformers' ``generate`` on the same GGUF weights and
prompt, and the memory floor: fp32 weight bytes over the copy bandwidth measured in this
run (decode must read every weight once per token).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from conflux_jax.bench.host_floor import copy_bandwidth_gbs


def ours_ms_per_token(prompt: str, tokens: int) -> tuple[float, float, int]:
    """(dense reference path, engine on a 1-rank Conflux executor) ms/token, weight bytes."""
    from conflux_jax.checkpoints import load_checkpoint
    from conflux_jax.engine import Engine, EngineConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig
    from conflux_jax.reference import ReferenceGenerator
    from conflux_jax.sampling import SamplingParams

    ckpt = load_checkpoint("default")
    ids = ckpt.tokenizer.encode(prompt, add_special_tokens=True)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    gen = ReferenceGenerator(ckpt.config, ckpt.params)
    stamps: list[float] = []

    def on_token(row, token, logprob, top):
        stamps.append(time.perf_counter())
        return len(stamps) >= tokens

    gen.generate([ids], [params], on_token)  # compile
    stamps.clear()
    gen.generate([ids], [params], on_token)
    dense = float(statistics.median(np.diff(stamps) * 1e3))

    engine = Engine(ckpt.config, ckpt.params, ckpt.tokenizer,
                    EngineConfig(executor=ExecutorConfig(mesh="sp=1,tp=1", max_model_len=512)))
    engine.generate([ids], [params])  # compile the step shapes it uses
    out = engine.generate([ids], [params])[0]
    engine_ms = float(statistics.median(np.diff(out.metrics["token_times_s"]) * 1e3))
    weight_bytes = sum(np.asarray(a).nbytes for a in _leaves(gen.params))
    return dense, engine_ms, weight_bytes


def hf_ms_per_token(prompt: str, tokens: int) -> float:
    import torch
    import transformers

    from conflux_jax.checkpoints import default_gguf_path

    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok(prompt, return_tensors="pt")["input_ids"]

    def timed(n: int) -> float:
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - t

    timed(2)
    # Difference of two runs cancels the prefill and set-up cost.
    return (timed(tokens + 1) - timed(1)) / tokens * 1e3


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    prompt = "The history of the city begins"
    bw = copy_bandwidth_gbs()
    ours, engine_ms, weight_bytes = ours_ms_per_token(prompt, args.tokens)
    floor = weight_bytes / (bw * 1e9) * 1e3
    hf = None if args.no_hf else hf_ms_per_token(prompt, args.tokens)
    result = {"ours_ms_per_token": ours, "engine_ms_per_token": engine_ms,
              "hf_ms_per_token": hf, "copy_gbs": bw,
              "weight_bytes": weight_bytes, "floor_ms_per_token": floor}
    print(f"copy bandwidth          {bw:8.1f} GB/s")
    print(f"memory floor            {floor:8.1f} ms/token  ({weight_bytes / 1e6:.0f} MB fp32)")
    print(f"conflux_jax (reference) {ours:8.1f} ms/token  ({ours / floor:.2f}x floor)")
    print(f"conflux_jax (engine)    {engine_ms:8.1f} ms/token  ({engine_ms / floor:.2f}x floor)")
    if hf is not None:
        print(f"HF transformers         {hf:8.1f} ms/token  ({hf / floor:.2f}x floor)")
        print(f"speed-up vs HF          {hf / ours:8.2f}x (reference), "
              f"{hf / engine_ms:.2f}x (engine)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
