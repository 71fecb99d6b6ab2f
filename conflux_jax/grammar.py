"""Structured outputs: grammars compiled by llguidance, matched token by token on the host.

One :class:`GrammarCompiler` per tokenizer turns a :class:`StructuredOutputsParams` into
an llguidance grammar and makes one :class:`Matcher` per request. A matcher writes the
packed allowed-token bitmask of its next token (``i32[ceil(V/32)]``, bit ``v % 32`` of
word ``v // 32``; llguidance's own numpy layout) that the on-device sampler applies, and
follows the request's committed output tokens: ``sync`` consumes what it has not seen and
rolls back what the request no longer holds.

llguidance was chosen over xgrammar (bench/RESULTS.md, "Structured outputs"): it needs no
torch, fills numpy bitmasks directly, and compiles schemas in about a millisecond.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np

from conflux_jax.sampling import StructuredOutputsParams, mask_words
from conflux_jax.tokenizer import Tokenizer


def _json_options(params: StructuredOutputsParams) -> dict[str, Any]:
    # Compact JSON: free whitespace lets a weak model spend its whole budget on blanks.
    return {"whitespace_flexible": False, "lenient": not params.strict}


class GrammarError(ValueError):
    """A constraint that does not compile (bad schema, regex or grammar)."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for ``params`` (not yet checked against a tokenizer)."""
    try:
        if params.json is not None:
            return llguidance.LLMatcher.grammar_from_json_schema(
                params.json if isinstance(params.json, dict) else json.dumps(params.json),
                defaults=_json_options(params))
        if params.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=_json_options(params))
        if params.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        assert params.grammar is not None
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as exc:
        raise GrammarError(f"the structured output constraint is invalid: {exc}") from None


def validate(params: StructuredOutputsParams) -> None:
    """Raise :class:`GrammarError` if ``params`` does not compile (no tokenizer needed:
    the checks a request can fail before it reaches the engine)."""
    message = llguidance.LLMatcher.validate_grammar(grammar_text(params), None)
    if message:
        raise GrammarError(f"the structured output constraint is invalid: {message}")


class GrammarCompiler:
    """Compiles constraints for one tokenizer and a model vocabulary of ``vocab_size``.

    Building llguidance's tokenizer view costs about 0.6 s for a 49k vocabulary, so it is
    built once, on the first constrained request.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self._tokenizer = tokenizer
        self._ll: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll is None:
            eos = list(self._tokenizer.eos_token_ids)
            self._ll = llguidance.LLTokenizer(
                self._tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=eos if eos else None)
        return self._ll

    def matcher(self, params: StructuredOutputsParams) -> Matcher:
        """A fresh matcher for ``params``; raises :class:`GrammarError` if it is invalid."""
        grammar = grammar_text(params)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.ll_tokenizer)
        if is_error:
            raise GrammarError(f"the structured output constraint is invalid: "
                               f"{messages[0]}")
        m = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if m.is_error():
            raise GrammarError(f"the structured output constraint is invalid: "
                               f"{m.get_error()}")
        return Matcher(m)

    def fill_masks(self, matchers: Sequence[Matcher], out: np.ndarray) -> None:
        """Row i of ``out`` (i32[len(matchers), W]) := the bitmask of ``matchers[i]``.

        llguidance computes the rows in parallel, without the GIL.
        """
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=2)
        llg_numpy.fill_next_token_bitmask_par(
            self._executor, [(m.ll, i) for i, m in enumerate(matchers)], out)


class Matcher:
    """One request's grammar state: ``consumed`` output tokens so far."""

    def __init__(self, ll: llguidance.LLMatcher) -> None:
        self.ll = ll
        self.consumed = 0

    def advance(self, token: int) -> bool:
        """Consume one sampled token; False if the grammar rejects it (an error state)."""
        ok = self.ll.consume_token(token)
        self.consumed += ok
        return bool(ok)

    def sync(self, output_ids: Sequence[int]) -> bool:
        """Match exactly ``output_ids``, the request's committed outputs: roll back tokens
        the request no longer holds, consume those not yet seen. False on a rejection."""
        n = len(output_ids)
        if self.consumed > n:
            if not self.ll.rollback(self.consumed - n):
                return False
            self.consumed = n
        while self.consumed < n:
            if not self.advance(output_ids[self.consumed]):
                return False
        return True

    @property
    def finished(self) -> bool:
        """The grammar is complete: nothing but end-of-sequence may follow."""
        return bool(self.ll.is_stopped())

    @property
    def error(self) -> str | None:
        return self.ll.get_error() if self.ll.is_error() else None
