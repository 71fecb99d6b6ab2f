#!/usr/bin/env bash
# GPU check for pallas_kernels: correctness of the compiled Pallas kernels, then timing.
#
#   bash bench/gpu_check.sh          # results under $OUT (or a fresh temp dir)
#
# Installs nothing: needs jax with CUDA, pytest, hypothesis and numpy importable. Runs in
# under 8 minutes: tests are capped at 280 s, the benchmark at 160 s (its sweep at 100 s).
# Exit status: 0 when tests pass and the benchmark ran; the performance targets are reported
# (bench.txt, kernels.json: meets_target_*), not enforced here.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-$(mktemp -d /tmp/conflux_gpu_check.XXXXXX)}"
mkdir -p "$OUT_DIR"
echo "results: $OUT_DIR"

python - <<'EOF' 2>&1 | tee "$OUT_DIR/env.txt"
import jax, jaxlib
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "backend", jax.default_backend())
print(jax.devices())
EOF
if [ "$(python -c 'import jax; print(jax.default_backend())')" != "gpu" ]; then
    echo "no GPU backend: this check is meant for a GPU machine" | tee -a "$OUT_DIR/env.txt"
    exit 2
fi

# Correctness: the same randomized and hand-picked checks as on CPU, against the compiled
# kernels (interpret mode is covered on CPU; skipping it here saves minutes).
export CONFLUX_KERNEL_TEST_IMPLS="xla,pallas"
timeout 280 python -m pytest -q -p no:cacheprovider -o addopts="" -rfE \
    --junitxml="$OUT_DIR/pytest.xml" tests/pallas_kernels 2>&1 | tee "$OUT_DIR/pytest.txt"
tests_rc=${PIPESTATUS[0]}
unset CONFLUX_KERNEL_TEST_IMPLS

# Timing: ceilings (copy, bf16 matmul), decode and prefill with a small tiling sweep.
timeout 160 python -m conflux_jax.bench kernels --json "$OUT_DIR/kernels.json" --budget-s 100 \
    2>&1 | tee "$OUT_DIR/bench.txt"
bench_rc=${PIPESTATUS[0]}

echo "pytest exit $tests_rc, bench exit $bench_rc" | tee "$OUT_DIR/summary.txt"
grep -E "^(ceilings|decode|prefill|write_kv)" "$OUT_DIR/bench.txt" >>"$OUT_DIR/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
