"""Our decoder against HF transformers (the independent oracle), fp32 on CPU."""

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from conflux_jax import LLM, SamplingParams, reference  # noqa: E402
from conflux_jax.checkpoints import default_gguf_path, load_checkpoint  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _tiny_hf(arch: str, tied: bool):
    torch.manual_seed(0)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=tied)
    if arch == "llama":
        cfg = transformers.LlamaConfig(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE, **common)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3Config(head_dim=32, **common)
        model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():  # larger-than-init weights make the comparison sharper
        for p in model.parameters():
            p.normal_(0.0, 0.1 if p.ndim > 1 else 1.0)
    return model.eval()


@pytest.mark.reference
@pytest.mark.parametrize("arch,tied", [("llama", False), ("llama", True), ("qwen3", False)])
def test_tiny_safetensors_logits_match_transformers(tmp_path: Path, arch, tied):
    model = _tiny_hf(arch, tied)
    model.save_pretrained(tmp_path, safe_serialization=True)
    _save_word_tokenizer(tmp_path, 256)
    ckpt = load_checkpoint(tmp_path)
    assert ckpt.config.rope_scaling is not None or arch != "llama"
    tokens = np.random.default_rng(0).integers(0, 256, 200)
    ours = np.asarray(reference.forward(ckpt.config, ckpt.params, tokens))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens)[None]).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 1e-4


def _save_word_tokenizer(folder: Path, vocab: int) -> None:
    """A model folder needs a tokenizer; these tests feed token ids, so any will do."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf_checkpoint):
    path = default_gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return hf, tok, smollm2_gguf_checkpoint


@pytest.mark.slow
@pytest.mark.reference
def test_smollm2_gguf_logits_match_transformers(smollm2):
    hf, tok, ckpt = smollm2
    text = ("In a small village by the sea, the fishermen woke before dawn to prepare their "
            "nets. The air was cold and the water calm, and they spoke quietly about the "
            "weather, the price of fish, and the festival planned for the weekend. Later, "
            "when the sun rose over the hills, the boats left the harbour one by one, "
            "their engines humming as gulls circled above the masts.")
    tokens = tok(text)["input_ids"][:64]
    assert len(tokens) == 64
    ours = np.asarray(reference.forward(ckpt.config, ckpt.params, tokens))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)[None]).logits[0].numpy()
    assert np.abs(ours - theirs).max() <= 1e-3
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.fixture(scope="module")
def default_llm():
    """One engine on the default model for the module's tests (loading and compiling it is
    most of their cost)."""
    return LLM(model="default")


def hf_greedy_agrees(hf, prompt_ids: list[int], ours: list[int], max_new: int) -> None:
    """``ours`` is HF's greedy continuation (what ``hf.generate(do_sample=False)`` returns)
    checked in one teacher-forced forward: every token is HF's argmax after the prompt and
    the tokens before it, and the run ends where greedy generation ends (EOS or max_new)."""
    eos = hf.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    assert 1 <= len(ours) <= max_new
    assert not eos & set(ours[:-1])  # HF would have stopped at an earlier EOS
    assert len(ours) == max_new or ours[-1] in eos
    with torch.no_grad():
        logits = hf(torch.tensor(prompt_ids + ours[:-1])[None]).logits[0]
    assert logits[len(prompt_ids) - 1:].argmax(-1).tolist() == ours


@pytest.mark.slow
@pytest.mark.reference
def test_smollm2_greedy_generation_matches_transformers(smollm2, default_llm):
    hf, tok, _ = smollm2
    llm = default_llm
    prompts = ["The capital of France is", "def fibonacci(n):",
               "Here are three tips for staying healthy:"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        assert ids[0].tolist() == out.prompt_token_ids
        hf_greedy_agrees(hf, out.prompt_token_ids, out.outputs[0].token_ids, 32)
    # and one request alone: its decode steps run the single-row buckets
    (solo,) = llm.generate(prompts[:1], SamplingParams(max_tokens=32, temperature=0))
    assert solo.outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.slow
def test_default_model_chat_answers_paris(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in out[0].outputs[0].text
