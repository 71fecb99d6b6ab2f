"""Two revisions of the engine on the same steps, run in alternating processes.

    python bench/ab_revisions.py OLD_REV [NEW_REV] [--rounds 3] [--repeats 12]
    python bench/ab_revisions.py OLD_REV [NEW_REV] [--rounds 3] --compare "COMPARE ARGS"

Each revision is checked out into a temporary git worktree (NEW_REV defaults to the
working tree itself). Every round runs one process per revision, old first: the process
serves ``bench compare``'s decode-heavy workload (32-token prompts) on the default model
in-process, keeps one real decode step of 16 requests and one of a single request (contexts
of ~100 tokens) and, from the prefill-heavy workload (128-token prompts), one step of a
256-token prefill chunk beside 16 requests' decodes; it times each, compiled, ``--repeats``
times. Printed: each round's median per revision and the old/new ratio. Rounds alternate
so that a host that speeds up or slows down during the run moves both sides alike;
compare the ratios, not the times.

With ``--compare``, each process is instead the revision's own ``python -m
conflux_jax.bench compare COMPARE ARGS`` (e.g. ``--peers server --concurrency 1 4 16
--repeats 1 --no-bound``): the whole engine loop, in-process and through its server, not
one compiled step. Printed: each system's and level's output tokens/s per round (the
best of the run's repeats) and the new/old ratio.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# Runs inside the revision's tree (its own conflux_jax first on sys.path).
CHILD = r"""
import json, sys, time
tree, repeats = sys.argv[1], int(sys.argv[2])
sys.path[:0] = [tree, tree + "/bench"]
import jax
import conflux_jax
assert conflux_jax.__file__.startswith(tree), conflux_jax.__file__
import step_breakdown as sb
from jax.sharding import NamedSharding
from conflux_jax.bench.serve import engine_from_model
from conflux_jax.executor.batch import StepBatch
engine = engine_from_model("default", 512, "conflux", 60.0, 10.0)
ex = engine.executor
out = {}
decode = lambda c: lambda plan: (not plan.prefill and len(plan.decode) == c
                                 and min(d.position + 1 for d in plan.decode) <= 100)
prefill = lambda plan: (bool(plan.prefill) and bool(plan.decode)
                        and sum(p.length for p in plan.prefill) >= 200)
for name, c, (prompt, out_len), want in (
        ("decode x16", 16, (32, 128), decode(16)), ("decode x1", 1, (32, 128), decode(1)),
        ("prefill 256 + decodes", 16, (128, 32), prefill)):
    shape, host = sb.capture(engine, prompt, out_len, c, want)
    ex.compile_shape(shape)
    batch = jax.device_put(host, jax.tree.map(lambda s: NamedSharding(ex.mesh, s),
                                              StepBatch.specs()))
    split = hasattr(ex, "_samplers")  # a step of forward + sampler (older trees: one)
    pooled = hasattr(ex, "kv_pools")  # one tuple of pools (older trees: k_pool, v_pool)

    def run(f, *rest):  # the forward on the executor's pools, which it then replaces
        if pooled:
            out = f(ex.params, ex.kv_pools, *rest)
            ex.kv_pools = out.kv_pools
        else:
            out = f(ex.params, ex.k_pool, ex.v_pool, *rest)
            ex.k_pool, ex.v_pool = out.k_pool, out.v_pool
        return out
    if hasattr(ex, "device_inputs"):  # packed inputs: the executor puts them itself
        forward, sampler = ex.compiled_step(shape)
        inputs = ex.device_inputs(host)
        def step():
            out = run(forward, *inputs.forward)
            return sampler(out.logits, inputs.sample)
    elif split:
        forward = ex._compiled[shape]
        sampler = ex._samplers[StepBatch.sample_rows(shape, ex.layout)]
        def step():
            out = run(forward, batch.rank, batch.shared)
            return sampler(out.logits, batch.sample)
    else:
        fused = ex._compiled[shape]
        def step():
            return run(fused, batch).sampled
    times = []
    for _ in range(repeats + 1):  # the first run is a warm-up
        t = time.perf_counter()
        jax.block_until_ready(step())
        times.append(time.perf_counter() - t)
    out[name] = times[1:]
print("AB-RESULT " + json.dumps(out))
"""


def run(tree: Path, repeats: int) -> dict[str, list[float]]:
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tree), str(repeats)],
                          capture_output=True, text=True, check=False)
    for line in proc.stdout.splitlines():
        if line.startswith("AB-RESULT "):
            return json.loads(line[len("AB-RESULT "):])
    raise RuntimeError(f"{tree}: no result\n{proc.stderr[-3000:]}")


def run_compare(tree: Path, compare_args: str) -> dict[str, list[float]]:
    """The revision's ``compare`` run in its tree: output tokens/s per system and level."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "compare.json"
        proc = subprocess.run([sys.executable, "-m", "conflux_jax.bench", "compare",
                               *shlex.split(compare_args), "--json", str(out)],
                              cwd=tree, capture_output=True, text=True, check=False)
        if proc.returncode or not out.exists():
            raise RuntimeError(f"{tree}: compare failed\n{proc.stderr[-3000:]}")
        report = json.loads(out.read_text())
    return {f"{system} x{row['concurrency']}": [row[system]["tokens_per_s"]]
            for row in report["rows"] for system in ("ours", *report["peers"])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new", nargs="?", help="a revision; default: the working tree")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--compare", metavar="ARGS",
                    help="run each revision's `bench compare ARGS` instead of timing steps")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for label, rev in (("old", args.old), ("new", args.new)):
            if rev is None:
                trees[label] = ROOT
                continue
            path = Path(tmp) / label
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                            str(path), rev], check=True)
            trees[label] = path
        try:
            medians: dict[str, dict[str, list[float]]] = {"old": {}, "new": {}}
            for _ in range(args.rounds):
                for label, tree in trees.items():
                    got = run(tree, args.repeats) if args.compare is None else \
                        run_compare(tree, args.compare)
                    for name, times in got.items():
                        medians[label].setdefault(name, []).append(float(np.median(times)))
        finally:
            for tree in trees.values():
                if tree != ROOT:
                    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                                    str(tree)], check=False)
    # Steps: median seconds (old/new > 1: new faster); compare: tokens/s (new/old).
    steps = args.compare is None
    scale, unit = (1e3, "median ms") if steps else (1.0, "output tokens/s (ours: in-process)")
    print(f"old = {args.old}, new = {args.new or 'working tree'}; {unit} per round")
    for name in medians["old"]:
        old, new = medians["old"][name], medians["new"][name]
        ratios = ", ".join(f"{(a / b if steps else b / a):.2f}x"
                           for a, b in zip(old, new, strict=True))
        print(f"  {name:<11} old {' / '.join(f'{scale * t:.1f}' for t in old)}"
              f"   new {' / '.join(f'{scale * t:.1f}' for t in new)}   "
              f"{'old/new' if steps else 'new/old'} {ratios}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
