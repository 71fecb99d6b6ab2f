"""Decode rate with and without a JSON-schema constraint, side by side in one run (issue 15).

    python bench/structured_decode.py [--streams 1 16] [--tokens 64] [--repeats 2]

Runs the embedded default model (SmolLM2-135M, CPU) in-process through ``LLM``. For each
stream count it generates ``--tokens`` tokens per stream, free (``ignore_eos``) and under a
JSON schema whose one string field needs more characters than the token budget (so both
run the full budget and end with ``length``), alternating them ``--repeats`` times and
keeping each one's fastest run. The constrained run goes twice: as the engine runs it
(each step's grammar masks filled while the device runs its forward) and with the masks
filled before the step is dispatched (the executor's ``prepare`` called first), which
shows what the overlap buys. Prints output tokens/s of each and the ratio
constrained / free, and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 2000}},
          "required": ["story"], "additionalProperties": False}
PROMPT = "Write a long story about a lighthouse keeper, as JSON with one field 'story'."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from conflux_jax import LLM, SamplingParams, StructuredOutputsParams

    llm = LLM("default")
    free = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=args.tokens, temperature=0.0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate([PROMPT], constrained)  # first use builds the grammar's tokenizer view
    executor = llm.engine.executor
    overlapped = executor.launch  # how the engine starts each step

    def masks_first(plan, prepare=None, after=None):  # noqa: ANN001, ANN202 - no overlap
        return overlapped(plan if prepare is None else prepare(plan), after=after)

    variants = (("free", free, overlapped), ("json_schema", constrained, overlapped),
                ("json_schema_masks_first", constrained, masks_first))
    rows = []
    for streams in args.streams:
        best = dict.fromkeys((v[0] for v in variants), 0.0)
        for _ in range(args.repeats):
            for name, params, launch in variants:
                executor.launch = launch
                t0 = time.perf_counter()
                outs = llm.generate([PROMPT] * streams, params)
                elapsed = time.perf_counter() - t0
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                if params is constrained:  # every output ran the full budget, on its schema
                    assert all(o.outputs[0].finish_reason == "length" for o in outs)
                best[name] = max(best[name], tokens / elapsed)
        executor.launch = overlapped
        ratio = best["json_schema"] / best["free"]
        serial = best["json_schema_masks_first"] / best["free"]
        rows.append({"streams": streams, "free_tok_s": best["free"],
                     "json_schema_tok_s": best["json_schema"], "ratio": ratio,
                     "json_schema_masks_first_tok_s": best["json_schema_masks_first"],
                     "masks_first_ratio": serial})
        print(f"{streams:>3} streams: free {best['free']:7.1f} tok/s   json_schema "
              f"{best['json_schema']:7.1f} tok/s   constrained / free {ratio:.2f}   "
              f"(masks before the step: {serial:.2f})", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"bench": "structured_decode", "tokens": args.tokens,
                                         "repeats": args.repeats, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
