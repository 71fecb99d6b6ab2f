"""``python -m conflux_jax.bench estimator --profile``: fit the latency model on this machine.

Times the real executor on random batches -- decode-only, prefill-only and mixed, with
heterogeneous contexts and per-rank splits -- fits the model of §6.2 by least squares,
writes the coefficients JSON for (model, hardware, mesh), and reports the MAPE on held-out
random heterogeneous batches that the fit never saw.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from conflux_jax.engine.profiler import PROFILE_BUDGET

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
    from conflux_jax.engine.profiler import ProfileSpace, profile
    from conflux_jax.scheduler.block_manager import BlockManager

    ex = build_executor(args.model, args.mesh, args.max_context)
    space = ProfileSpace(args.max_context, args.max_chunk, args.max_decodes,
                         ex.buckets.max_tokens, ex.model_config.vocab_size)
    train, test = profile(ex, space, args.train, args.test, args.repeats, args.seed,
                          blocks=BlockManager(ex.num_ranks, ex.kv.num_pages, ex.kv.page_size),
                          statistic=args.statistic)
    mesh = ex.mesh_spec
    return train, test, {
        "num_layers": ex.model_config.num_layers, "sp": mesh.sp, "tp": mesh.tp,
        "mesh": args.mesh, "token_buckets": list(ex.buckets.tokens),
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
    parser.add_argument("--train", type=int, default=PROFILE_BUDGET["num_train"])
    parser.add_argument("--test", type=int, default=PROFILE_BUDGET["num_test"])
    parser.add_argument("--repeats", type=int, default=PROFILE_BUDGET["repeats"],
                        help="timed runs per batch, one per round over all batches")
    parser.add_argument("--statistic", choices=["min", "median"],
                        default=PROFILE_BUDGET["statistic"],
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
