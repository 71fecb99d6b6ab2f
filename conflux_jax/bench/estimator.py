"""``python -m conflux_jax.bench estimator --profile``: fit the latency model on this machine.

Times the real executor on random batches -- decode-only, prefill-only and mixed, with
heterogeneous contexts and per-rank splits -- fits the model of §6.2 by least squares,
writes the coefficients JSON for (model, hardware, mesh), and reports the MAPE on held-out
random heterogeneous batches that the fit never saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from conflux_jax.scheduler.block_manager import BlockManager


def _random_plan(ex, bm, rng: np.random.Generator, kind: str, max_ctx: int,  # noqa: ANN001
                 max_chunk: int, max_decodes: int, vocab: int):
    """A random plan over new requests whose pages ``bm`` allocates (free with
    :func:`_release`). KV contents do not matter for timing, only the lengths."""
    from conflux_jax.plan import DecodeSlot, IterationPlan, PrefillPiece

    n = ex.num_ranks
    slots, pieces = [], []
    rid = 0
    if kind in ("decode", "mixed"):
        for r in range(n):
            for _ in range(int(rng.integers(0 if kind == "mixed" else 1, max_decodes + 1))):
                ctx = int(rng.integers(1, max_ctx))
                ids = rng.integers(3, vocab, ctx + 1).tolist()
                bm.transition(rid, r, ctx + 1)
                slots.append(DecodeSlot(rid, r, position=ctx, token_id=ids[-1],
                                        pages=bm.decode_pages(rid)))
                rid += 1
    if kind in ("prefill", "mixed"):
        room = ex.exec_config.buckets.max_tokens
        load = [0] * n
        for s in slots:
            load[s.rank] += 1
        for _ in range(int(rng.integers(1, 3))):
            free = [room - x for x in load]
            length = int(rng.integers(1, min(max_chunk, sum(free)) + 1))
            history = int(rng.integers(0, max_ctx - length)) if max_ctx > length + 1 else 0
            weights = rng.dirichlet(np.ones(n))
            counts = np.minimum(np.floor(weights * length).astype(int), free)
            while counts.sum() < length:  # top up the ranks that still have room
                r = int(rng.choice([i for i in range(n) if counts[i] < free[i]]))
                counts[r] += 1
            ids = rng.integers(3, vocab, history + length).tolist()
            bm.allocate_prefill(rid, history + length)
            pieces.append(PrefillPiece(rid, history, tuple(int(c) for c in counts),
                                       token_ids=tuple(ids[history:]),
                                       pages=bm.prefill_pages(rid)))
            load = [a + int(c) for a, c in zip(load, counts, strict=True)]
            rid += 1
    return IterationPlan(tuple(pieces), tuple(slots), 0.0)


def _timed(ex, plan) -> float:
    """Seconds of one run of ``plan``."""
    gc.collect()  # a collection inside a timed run is the interpreter's, not the step's
    gc.disable()
    try:
        t = time.perf_counter()
        ex.execute(plan)
        return time.perf_counter() - t
    finally:
        gc.enable()


def _reduce(times: list[float], statistic: str) -> float:
    return min(times) if statistic == "min" else statistics.median(times)


def _release(bm, plan) -> None:  # noqa: ANN001
    for rid in set(plan.request_ids):
        bm.free(rid)


def profile(ex, num_train: int, num_test: int, repeats: int, seed: int, max_ctx: int,
            max_chunk: int, max_decodes: int, progress: bool = True, statistic: str = "min",
            blocks: BlockManager | None = None):
    """Time ``num_train + num_test`` random batches, ``repeats`` times each, in rounds.

    Batches are timed in random order (a machine whose speed drifts would otherwise time
    every held-out batch after every training batch and bias the MAPE), and a batch's
    repeats are spread over the run, one per round (back-to-back repeats all fall into
    the same slow phase of a shared machine; across rounds the fastest escapes it). Each
    batch is drawn from its own seed, so every round re-creates it exactly. ``blocks``
    (a :class:`BlockManager` for the executor's KV pool) allocates the batches' pages.
    """
    from tqdm.auto import tqdm

    from conflux_jax.latency import BatchShape, ProfileSample
    from conflux_jax.scheduler.block_manager import BlockManager

    bm = blocks or BlockManager(ex.num_ranks, ex.kv.num_pages, ex.kv.page_size)
    vocab = ex.model_config.vocab_size
    kinds = ["decode", "prefill", "mixed"]
    jobs = [("train", kinds[i % 3]) for i in range(num_train)] + \
        [("test", "mixed" if i % 2 else kinds[i % 3]) for i in range(num_test)]
    jobs = [jobs[i] for i in np.random.default_rng(seed).permutation(len(jobs))]
    times: list[list[float]] = [[] for _ in jobs]
    shapes: list = [None] * len(jobs)
    bar = tqdm(total=repeats * len(jobs), desc="profiling", disable=not progress)
    for rnd in range(repeats):
        for j, (_, kind) in enumerate(jobs):
            plan = _random_plan(ex, bm, np.random.default_rng([seed, j]), kind, max_ctx,
                                max_chunk, max_decodes, vocab)
            if rnd == 0:
                ex.execute(plan)  # first run may compile
                shapes[j] = BatchShape.from_plan(plan, ex.num_ranks)
            times[j].append(_timed(ex, plan))
            _release(bm, plan)
            bar.update()
    bar.close()
    samples: dict[str, list] = {"train": [], "test": []}
    for (split, _), shape, ts in zip(jobs, shapes, times, strict=True):
        samples[split].append(ProfileSample(shape, _reduce(ts, statistic)))
    return samples["train"], samples["test"]


PROFILE_BUCKETS = dict(tokens=(16, 64, 256), decode=(16,), max_prefill_seqs=2)


def build_executor(model: str, mesh: str, max_context: int):
    """The warmed-up executor the profile times (also used by ``bench/timing_noise.py``)."""
    from conflux_jax.checkpoints import load_checkpoint
    from conflux_jax.executor.buckets import BucketConfig
    from conflux_jax.executor.jax_executor import ExecutorConfig, JaxExecutor

    ckpt = load_checkpoint(model)
    ec = ExecutorConfig(mesh=mesh, page_size=16, num_pages=512,
                        max_model_len=max_context + 16,
                        buckets=BucketConfig(**PROFILE_BUCKETS))
    ex = JaxExecutor(ckpt.config, ckpt.params, ec)
    ex.warmup()
    return ex


def _profile_executor(args: argparse.Namespace) -> tuple[list, list, dict]:
    """Time the real executor; returns (train, test, the setup the fit needs)."""
    ex = build_executor(args.model, args.mesh, args.max_context)
    train, test = profile(ex, args.train, args.test, args.repeats, args.seed,
                          args.max_context, args.max_chunk, args.max_decodes,
                          statistic=args.statistic)
    mesh = ex.mesh_spec
    return train, test, {
        "num_layers": ex.model_config.num_layers, "sp": mesh.sp, "tp": mesh.tp,
        "mesh": args.mesh, "token_buckets": list(ex.exec_config.buckets.tokens),
        "repeats": args.repeats, "statistic": args.statistic,
        "timing": "shuffled order, one repeat per batch per round",
        # Simulated CPU devices time-share the host's cores (see latency/model.py).
        "shared_cores": ex.mesh.devices.flat[0].platform == "cpu" and ex.num_ranks > 1}


def _load_samples(path: Path) -> tuple[list, list, dict]:
    """The samples and setup of an earlier ``--profile --json`` run."""
    from conflux_jax.latency import BatchShape, ProfileSample

    saved = json.loads(path.read_text())
    groups: dict[str, list] = {"train": [], "test": []}
    for s in saved["samples"]:
        shape = BatchShape(tuple(s["n_p"]), tuple(s["n_d"]), tuple(s["w_d"]), float(s["a_p"]))
        groups[s["split"]].append(ProfileSample(shape, float(s["seconds"])))
    setup = saved.get("setup") or _setup_from_model(saved["model"])
    return groups["train"], groups["test"], setup


def _setup_from_model(model: dict) -> dict:
    # Files written before "setup" was saved: the fitted model records the same facts.
    sp = int(model["num_ranks"])
    return {"num_layers": int(model["num_layers"]), "sp": sp, "tp": 1,
            "mesh": model["meta"].get("mesh", f"sp={sp},tp=1"),
            "token_buckets": list(model.get("token_buckets", [])),
            "shared_cores": bool(model.get("shared_cores", False))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conflux_jax.bench estimator",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true",
                        help="time the real executor and fit (the only mode so far)")
    parser.add_argument("--model", default="default")
    parser.add_argument("--mesh", default="sp=4,tp=1")
    parser.add_argument("--train", type=int, default=150)
    parser.add_argument("--test", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per batch, one per round over all batches")
    parser.add_argument("--statistic", choices=["min", "median"], default="min",
                        help="per batch: the fastest repeat (least disturbed) or the median")
    parser.add_argument("--max-context", type=int, default=1024)
    parser.add_argument("--max-chunk", type=int, default=192)
    parser.add_argument("--max-decodes", type=int, default=8, help="per rank")
    parser.add_argument("--hardware", default="cpu")
    parser.add_argument("--out", default=None, help="coefficients JSON (default: conventional)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    parser.add_argument("--from-samples", default=None, metavar="JSON",
                        help="refit the timings saved by an earlier --profile --json run "
                             "instead of profiling again")
    args = parser.parse_args(argv)
    if not args.profile and not args.from_samples:
        parser.error("nothing to do: pass --profile or --from-samples JSON")

    from conflux_jax.executor.mesh import devices_named_by, simulate_cpu_devices
    from conflux_jax.latency import coeffs_path, fit, mape, profile_name

    simulate_cpu_devices(devices_named_by(args.mesh, 4))  # as the server runs this mesh
    if args.from_samples:
        train, test, setup = _load_samples(Path(args.from_samples))
    else:
        train, test, setup = _profile_executor(args)
    name = profile_name(args.model)
    model = fit(train, setup["num_layers"], setup["sp"] * setup["tp"],
                meta={"model": name, "hardware": args.hardware, "mesh": setup["mesh"]},
                token_buckets=setup["token_buckets"], shared_cores=setup["shared_cores"])
    out = Path(args.out) if args.out else coeffs_path(name, args.hardware, setup["sp"],
                                                      setup["tp"])
    model.save(out)
    train_err, test_err = mape(model, train), mape(model, test)
    print(f"fitted {len(train)} training batches -> {out}")
    print(f"MAPE  train {train_err:5.2f}%   held-out ({len(test)} random heterogeneous "
          f"batches) {test_err:5.2f}%   [goal <= 5%; paper 4.1-4.8% on H100]")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "coefficients": str(out), "train_mape_pct": train_err, "test_mape_pct": test_err,
            "num_train": len(train), "num_test": len(test), "model": model.to_dict(),
            "setup": setup,
            # The raw timings, so other model forms can be fitted without re-profiling.
            "samples": [{"split": split, "seconds": smp.seconds,
                         **dataclasses.asdict(smp.shape)}
                        for split, group in (("train", train), ("test", test))
                        for smp in group]},
            indent=2))
    return 0
