"""Compare grammar engines for structured outputs: llguidance vs xgrammar.

For each JSON schema, N samples draw uniformly among the allowed tokens (a worst-case
"random model") until EOS; every finished sample is checked with jsonschema, and the
per-token mask fill is timed. Neither engine is needed by the other: install the one to
measure (xgrammar also needs torch and transformers).

    python bench/grammar_eval.py llguidance --tokenizer TOKENIZER_JSON
    python bench/grammar_eval.py xgrammar --tokenizer TOKENIZER_JSON
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import jsonschema
import numpy as np
import tokenizers

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "additionalProperties": False,
     "required": ["name", "age", "tags", "address"],
     "properties": {
         "name": {"type": "string", "maxLength": 12},
         "age": {"type": "integer", "minimum": 0, "maximum": 150},
         "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["a", "b", "c"]}},
         "address": {"type": "object", "additionalProperties": False,
                     "required": ["city", "zip"],
                     "properties": {"city": {"type": "string", "maxLength": 10},
                                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    {"type": "object", "additionalProperties": False, "required": ["x", "ok"],
     "properties": {"x": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                    "ok": {"type": "boolean"}}},
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["llguidance", "xgrammar"])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--eos", type=int, default=2)
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=300)
    a = ap.parse_args()
    tok = tokenizers.Tokenizer.from_file(a.tokenizer)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    start = time.perf_counter()
    if a.engine == "llguidance":
        import llguidance as llg
        import llguidance.numpy as lnp

        with open(a.tokenizer) as f:
            ll = llg.LLTokenizer(f.read(), eos_token=a.eos)
        bitmask = lnp.allocate_token_bitmask(1, vocab)

        def make(schema: dict) -> Any:
            g = llg.LLMatcher.grammar_from_json_schema(schema,
                                                       defaults={"whitespace_flexible": False})
            return lambda: llg.LLMatcher(ll, g)

        def fill(m: Any) -> np.ndarray:
            lnp.fill_next_token_bitmask(m, bitmask, 0)
            return bitmask[0]

        def consume(m: Any, t: int) -> bool:
            return m.consume_token(t)
    else:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        info = xgr.TokenizerInfo.from_huggingface(
            PreTrainedTokenizerFast(tokenizer_file=a.tokenizer), vocab_size=vocab,
            stop_token_ids=[a.eos])
        compiler = xgr.GrammarCompiler(info)
        bitmask = xgr.allocate_token_bitmask(1, vocab)  # a torch tensor

        def make(schema: dict) -> Any:
            cg = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
            return lambda: xgr.GrammarMatcher(cg)

        def fill(m: Any) -> np.ndarray:
            m.fill_next_token_bitmask(bitmask, 0)
            return bitmask[0].numpy()

        def consume(m: Any, t: int) -> bool:
            return m.accept_token(t)
    print(f"{a.engine}: tokenizer set-up {1e3 * (time.perf_counter() - start):.0f} ms")
    rng = np.random.default_rng(0)
    for i, schema in enumerate(SCHEMAS):
        t0 = time.perf_counter()
        new = make(schema)
        compile_ms = 1e3 * (time.perf_counter() - t0)
        times, valid, finished = [], 0, 0
        for _ in range(a.samples):
            m, out = new(), []
            for _ in range(a.max_tokens):
                t = time.perf_counter()
                words = fill(m)
                times.append(time.perf_counter() - t)
                allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8),
                                                       bitorder="little")[:vocab])
                token = int(rng.choice(allowed))
                if token == a.eos:
                    finished += 1
                    break
                assert consume(m, token)
                out.append(token)
            else:
                continue
            try:
                jsonschema.validate(json.loads(tok.decode(out)), schema)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        print(f"schema {i}: compile {compile_ms:.1f} ms, valid {valid}/{finished} finished "
              f"of {a.samples}, mask p50 {1e6 * np.median(times):.0f} us "
              f"p99 {1e6 * np.percentile(times, 99):.0f} us")


if __name__ == "__main__":
    main()
