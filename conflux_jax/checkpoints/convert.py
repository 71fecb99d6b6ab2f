"""``python -m conflux_jax.checkpoints``: convert checkpoints to orbax, inspect them.

    python -m conflux_jax.checkpoints convert SRC DST [--dtype float32|bfloat16] [--force]
    python -m conflux_jax.checkpoints info SPEC
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from conflux_jax.checkpoints.layout import SUPPORTED_DTYPES, iter_leaves
from conflux_jax.checkpoints.loader import load_checkpoint
from conflux_jax.checkpoints.orbax_store import save_orbax
from conflux_jax.models.params import CheckpointError


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def convert(src: str | Path, dst: str | Path, dtype: Any = "float32", *,
            overwrite: bool = False, progress: bool = True) -> Path:
    """Convert ``src`` (anything ``load_checkpoint`` reads) into an orbax checkpoint at
    ``dst`` with parameters in ``dtype``; returns the checkpoint's path."""
    t0 = time.perf_counter()
    if progress:
        _log(f"loading {src} ({dtype}) ...")
    ckpt = load_checkpoint(src, dtype, progress=progress)
    n = sum(a.size for _, a in iter_leaves(ckpt.params))
    if progress:
        _log(f"loaded {n / 1e6:.1f}M parameters in {time.perf_counter() - t0:.1f}s; "
             f"writing orbax checkpoint to {dst} ...")
    path = save_orbax(dst, ckpt.config, ckpt.params, ckpt.tokenizer, source=ckpt.source,
                      overwrite=overwrite)
    if progress:
        _log(f"done in {time.perf_counter() - t0:.1f}s")
    return path


def _info(spec: str) -> None:
    ckpt = load_checkpoint(spec)
    print(f"source: {ckpt.source}")
    for k, v in ckpt.config.to_dict().items():
        print(f"  {k}: {v}")
    n = sum(a.size for _, a in iter_leaves(ckpt.params))
    print(f"parameters: {n:,}")
    print(f"tokenizer: {ckpt.tokenizer.vocab_size} tokens, bos={ckpt.tokenizer.bos_token_id}, "
          f"eos={list(ckpt.tokenizer.eos_token_ids)}, "
          f"chat template: {'own' if ckpt.tokenizer.has_own_chat_template else 'ChatML'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conflux_jax.checkpoints",
                                     description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="convert a GGUF file or safetensors folder to orbax")
    conv.add_argument("src", help='.gguf file, HF safetensors folder, orbax dir or "default"')
    conv.add_argument("dst", help="output directory (must not exist, or be empty)")
    conv.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    conv.add_argument("--force", action="store_true", help="replace an existing DST")
    info = sub.add_parser("info", help="print a checkpoint's config")
    info.add_argument("spec")
    args = parser.parse_args(argv)
    try:
        if args.command == "convert":
            path = convert(args.src, args.dst, args.dtype, overwrite=args.force)
            print(path)
        else:
            _info(args.spec)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
