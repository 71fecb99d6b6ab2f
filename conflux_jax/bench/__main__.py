"""``python -m conflux_jax.bench <subcommand> ...``: one CLI for every benchmark.

Each subcommand is a module with ``main(argv: list[str] | None) -> int`` that owns its
own argparse (and takes ``--json PATH``). Modules are imported only when their
subcommand runs, so a heavy or not-yet-written benchmark never slows or breaks the
others. To add one, add a line to ``SUBCOMMANDS``.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "scheduler-overhead": ("conflux_jax.bench.overhead",
                           "per-iteration scheduling latency vs paper Table 5"),
    "sim": ("conflux_jax.bench.sim", "simulated goodput sweep of every policy"),
    "kernels": ("conflux_jax.bench.kernels", "attention kernel benchmarks"),
    "estimator": ("conflux_jax.bench.estimator",
                  "profile the real executor, fit the latency model, report MAPE"),
    "executor": ("conflux_jax.bench.executor", "XP vs baseline executor step times"),
    "host-time": ("conflux_jax.bench.host_time",
                  "host time per iteration at many resident decodes, share of the step"),
    "repro": ("conflux_jax.bench.repro", "paper Table 2 and Fig. 12 in simulation (H100)"),
    "serve": ("conflux_jax.bench.serve",
              "replay a workload against a server or in-process engine (vLLM metrics)"),
    "compare": ("conflux_jax.bench.compare",
                "real CPU serving vs HF transformers (and llama.cpp) at 1/4/16 concurrent"),
}


def _usage() -> str:
    lines = ["usage: python -m conflux_jax.bench <subcommand> [args...]", "", "subcommands:"]
    lines += [f"  {name:<20} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "run '<subcommand> --help' for its options"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        print(f"subcommand {name!r} is not available: {module_name} is missing",
              file=sys.stderr)
        return 2
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
