"""``python -m conflux_jax.bench kernels``: the attention kernel benchmark (bench/kernels.py)."""

from conflux_jax.bench._scripts import load_script


def main(argv: list[str] | None = None) -> int:
    return int(load_script("kernels").main(argv) or 0)
