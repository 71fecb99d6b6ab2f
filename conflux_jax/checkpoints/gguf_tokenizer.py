"""Rebuild a ``tokenizers`` byte-level BPE tokenizer from GGUF vocabulary metadata.

A GGUF has no ``tokenizer.json``: it carries the token list, the merges, token types and
``tokenizer.ggml.pre``, the name of the pre-tokenizer (text splitting) the vocabulary was
trained with. We map that name to the HF pre-tokenizer the original ``tokenizer.json``
used (llama.cpp keeps the equivalent regexes in ``llama-vocab.cpp``), so ids match the HF
tokenizer. E.g. SmolLM2 (``smollm``): every digit is its own piece, then GPT-2 splitting.
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader, Keys, TokenType
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from conflux_jax.checkpoints.gguf_meta import gguf_value
from conflux_jax.models.params import CheckpointError
from conflux_jax.tokenizer import Tokenizer

# Qwen2/3's split (same as Llama 3's but one digit per piece).
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Llama 3's split: numbers in groups of up to three digits.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

_GPT2_PRE = {"default", "gpt-2", "gpt2", "mpt", "olmo", "jais"}
_DIGITS_GPT2_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone",
                    "minerva"}
_LLAMA3_PRE = {"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"}
_QWEN2_PRE = {"qwen2", "deepseek-r1-qwen"}
SUPPORTED_PRE = sorted(_GPT2_PRE | _DIGITS_GPT2_PRE | _LLAMA3_PRE | _QWEN2_PRE)


def _pre_tokenizer(pre: str, source: str) -> pre_tokenizers.PreTokenizer:
    if pre in _GPT2_PRE:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGITS_GPT2_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    split = _LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT if pre in _QWEN2_PRE else None
    if split is None:
        raise CheckpointError(f"{source}: unsupported tokenizer pre-tokenizer {pre!r} "
                              f"(tokenizer.ggml.pre; supported: {SUPPORTED_PRE})")
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def gguf_tokenizer(reader: GGUFReader, source: str) -> Tokenizer:
    """The tokenizer described by the GGUF metadata (byte-level BPE, ``gpt2`` model)."""
    def get(key: str, default: Any = None) -> Any:
        return gguf_value(reader, key, default, source=source)

    model = get(Keys.Tokenizer.MODEL)
    if model != "gpt2":
        raise CheckpointError(f"{source}: unsupported tokenizer model {model!r} "
                              "(tokenizer.ggml.model; supported: 'gpt2' byte-level BPE)")
    tokens: list[str] = get(Keys.Tokenizer.LIST) or []
    merges: list[str] = get(Keys.Tokenizer.MERGES) or []
    types: list[int] = get(Keys.Tokenizer.TOKEN_TYPE) or []
    if not tokens or not merges:
        raise CheckpointError(f"{source}: GGUF has no tokenizer vocabulary or merges")
    pre = str(get(Keys.Tokenizer.PRE, "default"))

    vocab = {tok: i for i, tok in enumerate(tokens)}
    try:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        bpe = models.BPE(vocab=vocab, merges=pairs, ignore_merges=pre in _LLAMA3_PRE)
    except Exception as e:  # tokenizers rejects merges naming unknown tokens
        raise CheckpointError(f"{source}: GGUF tokenizer merges are inconsistent ({e})"
                              ) from None
    backend = HFTokenizer(bpe)
    backend.pre_tokenizer = _pre_tokenizer(pre, source)
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) and user-defined ones are matched whole in the text,
    # as llama.cpp and HF do; only control tokens count as "special" (skipped on decode).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types, strict=False)
                                if ty == TokenType.CONTROL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, ty in zip(tokens, types, strict=False)
                        if ty == TokenType.USER_DEFINED])

    bos = get(Keys.Tokenizer.BOS_ID)
    if bos is not None and get(Keys.Tokenizer.ADD_BOS, False):
        bos_tok = tokens[int(bos)]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos_tok} $A", pair=f"{bos_tok} $A {bos_tok} $B:1",
            special_tokens=[(bos_tok, int(bos))])
    eos = [get(k) for k in (Keys.Tokenizer.EOS_ID, Keys.Tokenizer.EOT_ID,
                            Keys.Tokenizer.EOM_ID)]
    template = get(Keys.Tokenizer.CHAT_TEMPLATE)
    return Tokenizer(backend,
                     bos_token_id=None if bos is None else int(bos),
                     eos_token_ids=[int(e) for e in eos if e is not None],
                     chat_template=template if isinstance(template, str) else None)
