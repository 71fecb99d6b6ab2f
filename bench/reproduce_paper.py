"""Regenerate the paper-reproduction numbers of bench/RESULTS.md (simulation, H100 roofline).

    python bench/reproduce_paper.py [--out-dir bench/results] [--num-requests 1000]

Runs ``python -m conflux_jax.bench repro`` twice: the default toolagent-like workload
(Mooncake-shaped, Table 3 P50/P95) for Table 2 and Fig. 12, then Fig. 12 again on the
lognormal toolagent variant to show the workload-shape sensitivity. Writes
``paper_repro.{json,md}`` and ``paper_repro_lognormal.{json,md}``; the RESULTS.md tables
are these markdown files. About 5-8 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from conflux_jax.bench.repro import main as repro


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--skip-lognormal", action="store_true")
    args = ap.parse_args(argv)
    n = ["--num-requests", str(args.num_requests)]
    rc = repro(["--part", "all", *n, "--json", str(args.out_dir / "paper_repro.json"),
                "--markdown", str(args.out_dir / "paper_repro.md")])
    if not args.skip_lognormal:
        rc |= repro(["--part", "fig12", "--trace", "toolagent-lognormal", *n,
                     "--json", str(args.out_dir / "paper_repro_lognormal.json"),
                     "--markdown", str(args.out_dir / "paper_repro_lognormal.md")])
    return rc


if __name__ == "__main__":
    sys.exit(main())
