"""The offline Python API, shaped like vLLM's: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from conflux_jax.outputs import OutputTracker, RequestOutput
from conflux_jax.reference import ReferenceGenerator
from conflux_jax.sampling import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """Load a model and generate from it in-process (notebooks, scripts, tests).

    ``model`` is ``"default"`` (the embedded SmolLM2-135M-Instruct), a ``.gguf`` file, an
    HF safetensors folder or an orbax checkpoint written by ``conflux_jax.checkpoints``.
    """

    def __init__(self, model: str = "default", *, dtype: str = "float32",
                 max_model_len: int | None = None):
        from conflux_jax.checkpoints import load_checkpoint

        ckpt = load_checkpoint(model, dtype=dtype)
        self.model_name = model
        self.config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self._generator = ReferenceGenerator(ckpt.config, ckpt.params, dtype=dtype)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order. Prompts are text or token-id lists."""
        if isinstance(prompts, str) or (
                isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        sampling_params = _per_prompt(sampling_params, len(prompts))
        texts = [p if isinstance(p, str) else None for p in prompts]
        token_lists = [self.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str)
                       else [int(t) for t in p] for p in prompts]
        return self._generate(texts, token_lists, sampling_params)

    def _generate(self, texts: Sequence[str | None], token_lists: list[list[int]],
                  sampling_params: Sequence[SamplingParams]) -> list[RequestOutput]:
        for ids in token_lists:
            self._check_prompt(ids)
        trackers = [
            OutputTracker(self.tokenizer, sp, max_new_tokens=min(
                sp.max_tokens or self.max_model_len, self.max_model_len - len(ids)))
            for sp, ids in zip(sampling_params, token_lists, strict=True)]

        def on_token(row: int, token: int, logprob: float, top: dict[int, float]) -> bool:
            t = trackers[row]
            t.append(token, logprob, top if t.params.logprobs else None)
            return t.finished

        self._generator.generate(token_lists, sampling_params, on_token, self.max_model_len)
        return [
            RequestOutput(request_id=str(next(self._ids)), prompt=text, prompt_token_ids=ids,
                          outputs=[t.completion()], finished=True)
            for text, ids, t in zip(texts, token_lists, trackers, strict=True)]

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them)."""
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        texts = [self.tokenizer.apply_chat_template(list(c),
                                                    add_generation_prompt=add_generation_prompt)
                 for c in conversations]
        sampling_params = _per_prompt(sampling_params, len(texts))
        # The template already places any BOS; encoding must not add another.
        token_lists = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        return self._generate(texts, token_lists, sampling_params)

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; the model's context is "
                             f"{self.max_model_len} tokens and generation needs at least one")
        vocab = self.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary (size {vocab})")


def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts")
    return list(sampling_params)
