"""``python -m conflux_jax.bench executor``: XP vs baseline step times (bench/executor_steps.py)."""

from conflux_jax.bench._scripts import load_script


def main(argv: list[str] | None = None) -> int:
    load_script("executor_steps").main(argv)
    return 0
