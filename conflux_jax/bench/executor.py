"""Step time per bucket: the Conflux (XP) step vs the two baseline modes, same run.

    python -m conflux_jax.bench executor [--model default] [--json PATH] [--startup]

On a 4-device mesh (simulated on CPU) it times one iteration carrying the same work --
``decodes`` resident decodes per rank plus one prefill chunk -- three ways:

* XP: one co-batched step on ``sp=4`` (prefill Ulysses-SP, decode rank-local);
* isolated (LoongServe-like): a prefill-only step plus a decode-only step on ``sp=4``;
* TP-chunked (Sarathi/vLLM-like): one co-batched step on ``sp=1, tp=4``.

``--startup`` also measures start-up to first token with a cold and a warm persistent
compilation cache (two fresh processes sharing one new cache directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from conflux_jax.checkpoints import Checkpoint
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.executor.jax_executor import JaxExecutor
    from conflux_jax.plan import DecodeSlot, IterationPlan, PrefillPiece
    from conflux_jax.scheduler.block_manager import BlockManager

# The engine's modules are imported where they are used, so that ``--help`` works without
# loading (or depending on the internals of) the executor.

SIMULATED_DEVICES = "--xla_force_host_platform_device_count=4"


def _build(model: str, mesh: str, buckets: BucketConfig, max_len: int,
           num_pages: int) -> tuple[JaxExecutor, BlockManager, Checkpoint]:
    """An executor and the block manager that allocates its pages (as the scheduler's)."""
    from conflux_jax.checkpoints import load_checkpoint
    from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor
    from conflux_jax.scheduler.block_manager import BlockManager

    ckpt = load_checkpoint(model)
    ec = ExecutorConfig(mesh=mesh, page_size=16, num_pages=num_pages, max_model_len=max_len,
                        buckets=buckets)
    ex = JaxExecutor(ckpt.config, ckpt.params, ec)
    return ex, BlockManager(ex.num_ranks, num_pages, ec.page_size), ckpt


def _resident_decodes(ex: JaxExecutor, bm: BlockManager, per_rank: int, context: int,
                      vocab: int) -> list[DecodeSlot]:
    """Prefill ``per_rank`` requests per rank to ``context`` tokens and park them there."""
    from conflux_jax.plan import DecodeSlot, IterationPlan, PrefillPiece

    n = ex.num_ranks
    slots = []
    rng = np.random.default_rng(0)
    for r in range(n):
        for _ in range(per_rank):
            rid = len(bm.requests)
            ids = rng.integers(3, vocab, context).tolist()
            bm.allocate_prefill(rid, context)
            bm.transition(rid, r, context + 8, keep_prefill=True)
            counts = [context // n] * n
            counts[-1] += context - sum(counts)
            piece = PrefillPiece(rid, 0, tuple(counts), True, r, token_ids=tuple(ids),
                                 pages=bm.prefill_pages(rid), decode_pages=bm.decode_pages(rid))
            out = ex.execute(IterationPlan((piece,), (), 0.0))
            bm.release_prefill(rid)
            slots.append(DecodeSlot(rid, r, position=context, token_id=out.sampled[rid].token,
                                    pages=bm.decode_pages(rid), sample_step=1))
    return slots


def _prefill_piece(bm: BlockManager, rid: int, length: int, vocab: int,
                   counts: tuple[int, ...]) -> PrefillPiece:
    """A first chunk of ``length`` random tokens for a new request ``rid``."""
    from conflux_jax.plan import PrefillPiece

    ids = np.random.default_rng(rid).integers(3, vocab, length).tolist()
    bm.allocate_prefill(rid, length)
    return PrefillPiece(rid, 0, counts, token_ids=tuple(ids), pages=bm.prefill_pages(rid))


def _time(ex: JaxExecutor, plan: IterationPlan, repeats: int) -> float:
    ex.execute(plan)  # compile / warm
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        ex.execute(plan)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def step_times(model: str, decodes: int, context: int, chunks: list[int], repeats: int,
               max_len: int) -> list[dict[str, Any]]:
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.plan import IterationPlan

    buckets = BucketConfig(tokens=(16, 64, 256, 1024), decode=(16,), max_prefill_seqs=2)
    xp, xp_bm, ckpt = _build(model, "sp=4,tp=1", buckets, max_len, num_pages=256)
    tp, tp_bm, _ = _build(model, "sp=1,tp=4", buckets, max_len, num_pages=1024)  # same KV
    vocab = ckpt.config.vocab_size
    xp_slots = _resident_decodes(xp, xp_bm, decodes, context, vocab)
    tp_slots = _resident_decodes(tp, tp_bm, decodes * 4, context, vocab)
    rows = []
    for chunk in chunks:
        n = xp.num_ranks
        rid = len(xp_bm.requests)
        counts = tuple([chunk // n] * (n - 1) + [chunk - chunk // n * (n - 1)])
        piece = _prefill_piece(xp_bm, rid, chunk, vocab, counts)
        t_xp = _time(xp, IterationPlan((piece,), tuple(xp_slots), 0.0), repeats)
        t_pre = _time(xp, IterationPlan((piece,), (), 0.0, mode="isolated_prefill"), repeats)
        t_dec = _time(xp, IterationPlan((), tuple(xp_slots), 0.0, mode="isolated_decode"),
                      repeats)
        rid_tp = len(tp_bm.requests)
        t_tp = _time(tp, IterationPlan((_prefill_piece(tp_bm, rid_tp, chunk, vocab, (chunk,)),),
                                       tuple(tp_slots), 0.0, mode="tp_chunked"), repeats)
        rows.append({"prefill_chunk": chunk, "decodes_total": decodes * n,
                     "xp_ms": t_xp, "isolated_ms": t_pre + t_dec, "isolated_prefill_ms": t_pre,
                     "isolated_decode_ms": t_dec, "tp_chunked_ms": t_tp})
        xp_bm.free(rid)
        tp_bm.free(rid_tp)
    return rows


def startup_to_first_token(model: str) -> dict[str, float]:
    """Two fresh processes, one new cache dir: cold compile, then warm cache."""
    code = ("import os,time; t=time.perf_counter(); "
            f"os.environ.setdefault('XLA_FLAGS',{SIMULATED_DEVICES!r}); "
            "from conflux_jax import LLM, SamplingParams; "
            f"llm=LLM({model!r}); llm.engine.executor.warmup(progress=False); "
            "llm.generate('Hello', SamplingParams(max_tokens=1, temperature=0)); "
            "print(time.perf_counter()-t)")
    out = {}
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "CONFLUX_COMPILE_CACHE": cache}
        for label in ("cold", "warm"):
            res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                 text=True, check=True)
            out[f"{label}_s"] = float(res.stdout.strip().splitlines()[-1])
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time the steps (and start-up with ``--startup``), print the table, return figures."""
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = step_times(args.model, args.decodes, args.context, chunks, args.repeats,
                      args.max_model_len)
    print(f"{'chunk':>6} {'decodes':>7} {'XP ms':>9} {'isolated ms':>12} {'TP-chunked ms':>14}"
          f" {'isolated/XP':>12} {'TP/XP':>7}")
    for r in rows:
        print(f"{r['prefill_chunk']:>6} {r['decodes_total']:>7} {r['xp_ms']:>9.1f} "
              f"{r['isolated_ms']:>12.1f} {r['tp_chunked_ms']:>14.1f} "
              f"{r['isolated_ms'] / r['xp_ms']:>12.2f} {r['tp_chunked_ms'] / r['xp_ms']:>7.2f}")
    result: dict[str, Any] = {"steps": rows}
    if args.startup:
        result["startup"] = startup_to_first_token(args.model)
        s = result["startup"]
        print(f"start-up to first token: cold cache {s['cold_s']:.1f} s, "
              f"warm cache {s['warm_s']:.1f} s ({s['cold_s'] / s['warm_s']:.2f}x)")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conflux_jax.bench executor",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--decodes", type=int, default=4, help="resident decodes per rank")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--chunks", default="64,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--startup", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    # Both meshes need 4 devices; on CPU XLA only honours this before its backend starts,
    # which nothing before main() does. XLA_FLAGS set by the caller win.
    os.environ.setdefault("XLA_FLAGS", SIMULATED_DEVICES)
    result = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
