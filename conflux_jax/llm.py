"""The offline Python API, shaped like vLLM's: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conflux_jax.engine import Engine, EngineConfig
from conflux_jax.executor.device import default_platform, resolve_dtype
from conflux_jax.executor.jax_executor import ExecutorConfig
from conflux_jax.outputs import RequestOutput
from conflux_jax.sampling import SamplingParams

Prompt = str | Sequence[int]
Message = dict[str, Any]


class LLM:
    """Load a model and generate from it in-process (notebooks, scripts, tests).

    ``model`` is ``"default"`` (the embedded SmolLM2-135M-Instruct), a ``.gguf`` file, an
    HF safetensors folder or an orbax checkpoint written by ``conflux_jax.checkpoints``.
    ``mesh`` is ``"sp=4,tp=1"`` style; the default uses every local device as an ``sp``
    rank (on CPU set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before jax is
    imported to simulate N devices). Step shapes compile on first use; call
    ``llm.engine.executor.warmup()`` to compile them all up front. ``checkpoint_dir`` is
    where the default model's converted checkpoint is kept (see
    ``conflux_jax.checkpoints.default_model.resolve_store`` for the default).
    ``dtype="auto"`` runs bfloat16 on a GPU/TPU and float32 on CPU (either is accepted
    anywhere); ``gpu_memory_utilization`` sizes the KV pool from device memory as vLLM's
    flag does (the default on a GPU/TPU is 0.9). ``enable_prefix_caching=False`` turns
    off automatic prefix caching (on by default, as in vLLM); ``async_scheduling=False``
    runs one iteration at a time (see ``EngineConfig.async_scheduling``).
    """

    def __init__(self, model: str = "default", *, mesh: str | None = None,
                 dtype: str = "auto", max_model_len: int | None = None,
                 policy: str = "conflux", engine_config: EngineConfig | None = None,
                 checkpoint_dir: str | Path | None = None,
                 gpu_memory_utilization: float | None = None,
                 enable_prefix_caching: bool = True, async_scheduling: bool = True):
        from conflux_jax.checkpoints import load_checkpoint

        if engine_config is not None and engine_config.executor.dtype != "auto":
            dtype = engine_config.executor.dtype  # the weights load as the engine runs
        dtype = resolve_dtype(dtype, default_platform())
        ckpt = load_checkpoint(model, dtype=dtype, checkpoint_dir=checkpoint_dir)
        self.model_name = model
        self.config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        if engine_config is None:
            max_len = min(max_model_len or 2048, self.config.max_position_embeddings)
            engine_config = EngineConfig(
                executor=ExecutorConfig(mesh=mesh, dtype=dtype, max_model_len=max_len,
                                        gpu_memory_utilization=gpu_memory_utilization),
                policy=policy, profile=model, enable_prefix_caching=enable_prefix_caching,
                async_scheduling=async_scheduling)
        elif engine_config.executor.dtype == "auto":
            engine_config = dataclasses.replace(engine_config, executor=dataclasses.replace(
                engine_config.executor, dtype=dtype))
        if not enable_prefix_caching:
            engine_config = dataclasses.replace(engine_config, enable_prefix_caching=False)
        if not async_scheduling:
            engine_config = dataclasses.replace(engine_config, async_scheduling=False)
        self.engine = Engine(ckpt.config, ckpt.params, ckpt.tokenizer, engine_config)
        self.max_model_len = self.engine.max_model_len

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
        outs = self.engine.generate(token_lists, sampling_params)
        for out, text in zip(outs, texts, strict=True):
            out.prompt = text
        return outs

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


def _per_prompt(sampling_params: SamplingParams | Sequence[SamplingParams] | None,
                n: int) -> list[SamplingParams]:
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if len(sampling_params) != n:
        raise ValueError(f"got {len(sampling_params)} SamplingParams for {n} prompts")
    return list(sampling_params)
