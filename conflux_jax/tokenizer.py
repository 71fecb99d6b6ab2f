"""Text <-> token ids, streaming detokenization and chat templates.

A thin layer over a ``tokenizers.Tokenizer`` (the fast HF backend) that adds what serving
needs on top: the special token ids the scheduler stops on, an incremental decoder that
never emits half a UTF-8 character, and the checkpoint's own jinja chat template
(ChatML when it has none). On disk it is HF-compatible: ``tokenizer.json`` plus
``tokenizer_config.json`` (and ``chat_template.jinja`` when a checkpoint ships one).
"""

from __future__ import annotations

import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers.decoders import DecodeStream

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(ValueError):
    """Tokenizer files are missing or malformed, or a chat template failed to render."""


class Tokenizer:
    """Encode, decode and chat-format text for one model.

    ``eos_token_ids`` is every id that ends a turn (e.g. Llama 3's ``<|eot_id|>`` as well
    as ``<|end_of_text|>``); ``bos_token_id`` may be ``None``.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None = None,
        eos_token_ids: Iterable[int] = (),
        chat_template: str | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        self._chat_template = chat_template

    @classmethod
    def word_level(cls, vocab_size: int, eos_token_ids: Iterable[int] = (2,)) -> Tokenizer:
        """Token i <-> word "w{i}", split on whitespace: what random-weight models in
        benchmarks and tests need (no real tokenizer to load)."""
        backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
            {f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        return cls(backend, eos_token_ids=eos_token_ids)

    # ----------------------------------------------------------------- basic properties
    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (model vocab may be padded beyond it)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_token_id is None else self.backend.id_to_token(self.bos_token_id)

    @property
    def eos_token(self) -> str | None:
        if not self.eos_token_ids:
            return None
        return self.backend.id_to_token(self.eos_token_ids[0])

    @property
    def chat_template(self) -> str:
        """The checkpoint's template, or ChatML when it has none."""
        return self._chat_template or CHATML_TEMPLATE

    def with_chat_template(self, template: str) -> Tokenizer:
        """This tokenizer with another chat template (a server's ``--chat-template``)."""
        return Tokenizer(self.backend, bos_token_id=self.bos_token_id,
                         eos_token_ids=self.eos_token_ids, chat_template=template)

    @property
    def has_own_chat_template(self) -> bool:
        return self._chat_template is not None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ----------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``)
        map to their ids, as in HF; ``add_special_tokens`` adds e.g. a BOS when the
        tokenizer's post-processor is configured to."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False
                     ) -> list[list[int]]:
        encs = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encs]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------- chat template
    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        try:
            return _jinja_env().from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"chat template does not compile: {e}") from None

    @cached_property
    def supports_tools(self) -> bool:
        """The template renders a ``tools`` list (as HF's tool-aware templates do)."""
        try:
            ast = _jinja_env().parse(self.chat_template)
        except jinja2.TemplateError:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(ast)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) into the prompt text.

        Extra keyword arguments (``tools``, ``documents``, ...) are passed to the template,
        as HF does.
        """
        context: dict[str, Any] = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **template_kwargs,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._compiled_template.render(**context)
        except TokenizerError:
            raise
        except (jinja2.TemplateError, TypeError, KeyError, AttributeError) as e:
            raise TokenizerError(f"chat template failed to render: {e}") from None

    # ----------------------------------------------------------------- persistence
    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backend.save(str(directory / TOKENIZER_FILE))
        cfg: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            # Not an HF key: HF keeps extra stop ids in generation_config.json.
            "eos_token_ids": list(self.eos_token_ids),
            "bos_token_id": self.bos_token_id,
            "chat_template": self._chat_template,
            "tokenizer_class": "PreTrainedTokenizerFast",
        }
        (directory / TOKENIZER_CONFIG_FILE).write_text(json.dumps(cfg, indent=2,
                                                                  ensure_ascii=False))

    @classmethod
    def from_dir(cls, directory: str | Path, extra_eos_token_ids: Iterable[int] = ()
                 ) -> Tokenizer:
        """Load from an HF-style folder (``tokenizer.json`` + optional
        ``tokenizer_config.json`` / ``chat_template.jinja``) or one written by ``save``."""
        directory = Path(directory)
        tok_path = directory / TOKENIZER_FILE
        if not tok_path.is_file():
            raise TokenizerError(f"{tok_path}: tokenizer file not found")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # the Rust side raises plain Exception
            raise TokenizerError(f"{tok_path}: not a valid tokenizer.json ({e})") from None

        cfg_path = directory / TOKENIZER_CONFIG_FILE
        cfg: dict[str, Any] = {}
        if cfg_path.is_file():
            try:
                cfg = json.loads(cfg_path.read_text())
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{cfg_path}: not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{cfg_path}: expected a JSON object")

        def token_id(key: str) -> int | None:
            tok = cfg.get(key)
            if isinstance(tok, dict):  # older HF files: {"content": "<s>", ...}
                tok = tok.get("content")
            return backend.token_to_id(tok) if isinstance(tok, str) else None

        bos = cfg.get("bos_token_id")
        if bos is None:
            bos = token_id("bos_token")
        eos: list[int] = list(cfg.get("eos_token_ids") or [])
        if not eos and (e := token_id("eos_token")) is not None:
            eos.append(e)
        eos.extend(extra_eos_token_ids)

        template_path = directory / CHAT_TEMPLATE_FILE
        template: Any = (template_path.read_text() if template_path.is_file()
                         else cfg.get("chat_template"))
        if isinstance(template, list):  # HF named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        return cls(backend, bos_token_id=bos, eos_token_ids=eos,
                   chat_template=template if isinstance(template, str) else None)


class IncrementalDecoder:
    """Turns a stream of ids into a stream of text, one ``push`` at a time.

    Text is only emitted once it is complete: a character whose UTF-8 bytes are split
    across byte-level tokens is held back until its last byte arrives. The concatenation
    of everything ``push`` and ``flush`` return equals ``tokenizer.decode(all_ids)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._ids: list[int] = []
        self._emitted: list[str] = []

    def push(self, ids: int | Sequence[int]) -> str:
        """Add one id or several; return the newly completed text ("" if none yet)."""
        if type(ids) is int:  # the serving loop's case, once per token: no list, no join
            self._ids.append(ids)
            chunk = self._stream.step(self._tokenizer.backend, ids) or ""
            if chunk:
                self._emitted.append(chunk)
            return chunk
        try:  # one id (int or numpy integer) or an iterable of them
            batch = [operator.index(ids)]  # type: ignore[arg-type]
        except TypeError:
            batch = [int(i) for i in ids]  # type: ignore[union-attr]
        out: list[str] = []
        for i in batch:  # one at a time: DecodeStream holds back incomplete UTF-8 per step
            self._ids.append(i)
            chunk = self._stream.step(self._tokenizer.backend, i)
            if chunk:
                out.append(chunk)
        text = "".join(out)
        if text:
            self._emitted.append(text)
        return text

    def flush(self) -> str:
        """At the end of the stream: return what is still held back (an incomplete
        trailing character decodes to U+FFFD, exactly as a full ``decode`` renders it)."""
        full = self._tokenizer.decode(self._ids, skip_special_tokens=self._skip)
        done = self.text
        rest = full[len(done):] if full.startswith(done) else ""
        if rest:
            self._emitted.append(rest)
        return rest

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._emitted)

    @property
    def ids(self) -> list[int]:
        return list(self._ids)


class TemplateRaisedError(TokenizerError):
    """A chat template called ``raise_exception`` (e.g. roles out of order)."""


def _raise_exception(message: str) -> None:
    raise TemplateRaisedError(f"chat template error: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # HF overrides jinja's tojson: no HTML escaping, unicode kept as is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _jinja_env() -> ImmutableSandboxedEnvironment:
    """The environment HF renders chat templates in (sandboxed; same globals/filters)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
