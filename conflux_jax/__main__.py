"""`python -m conflux_jax generate|chat TEXT`: one-shot generation from the command line."""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m conflux_jax", description=__doc__)
    parser.add_argument("mode", choices=["generate", "chat"])
    parser.add_argument("text", help="the prompt (generate) or the user message (chat)")
    parser.add_argument("--model", default="default",
                        help="'default', a .gguf file, a safetensors folder or an orbax dir")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                        help="where the default model is converted to and read from "
                             "(default: $CONFLUX_CHECKPOINT_DIR, else a source checkout's "
                             "checkpoints/, else ~/.cache/conflux_jax/checkpoints)")
    args = parser.parse_args(argv)
    # Our INFO lines (which checkpoint store is used) on stderr; other libraries stay quiet.
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("conflux_jax").setLevel(logging.INFO)

    from conflux_jax import LLM, SamplingParams

    llm = LLM(model=args.model, checkpoint_dir=args.checkpoint_dir)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            seed=args.seed)
    if args.mode == "chat":
        out = llm.chat([{"role": "user", "content": args.text}], params)[0]
    else:
        out = llm.generate(args.text, params)[0]
    sys.stdout.write(out.outputs[0].text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
