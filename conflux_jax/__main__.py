"""`python -m conflux_jax generate|chat TEXT`: one-shot generation from the command line."""

from __future__ import annotations

import argparse
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
    args = parser.parse_args(argv)

    from conflux_jax import LLM, SamplingParams

    llm = LLM(model=args.model)
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
