#!/usr/bin/env bash
# GPU check: engine-step and kernel correctness, kernel timings against the device's
# ceilings, and a short serve benchmark of Llama-3.1-8B-shaped random weights in bf16.
#
#   bash bench/gpu_check.sh [BUDGET_S]      # results under $OUT (or a fresh temp dir)
#
# Installs and downloads nothing: needs jax with CUDA (the `gpu` extra), pytest,
# hypothesis, numpy, flax, tokenizers and this package importable (it runs from the
# checkout). The whole check ends within BUDGET_S seconds (default 420), so one device
# call of a 15-minute lease leaves room for a rerun; each stage has its own share and a
# stage that runs out is cut, not the check:
#   1. step     the whole engine step (compiled Pallas kernel inside) vs the dense
#               reference, fp32 and bf16, tiny random Llama                     <= 12%
#   2. kernels  tests/pallas_kernels against the compiled kernels              <= 22%
#   3. timings  copy bandwidth, bf16 matmul peak, decode / prefill attention (Pallas with
#               a small tiling sweep, and the jnp path beside it)               <= 18%
#   4. serve    8B-shaped bf16 weights, KV pool from --gpu-memory-utilization,
#               warm-up with calibration, one offline batch, 64-decode step     the rest
# Output (at most 8 files, as the device tool returns): log.txt (everything printed),
# check.json (every stage's result; "ok" = correctness passed and every stage ran),
# step.json, pytest.txt, kernels.json, serve.json.
# Exit status 0 when correctness passed and every stage ran; performance is reported
# (kernels.json meets_target_*, serve.json), not enforced.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-$(mktemp -d /tmp/conflux_gpu_check.XXXXXX)}"
mkdir -p "$OUT_DIR"
budget=${1:-420}
start=$SECONDS
# A fresh machine: keep compiles of one run in one cache (the serve stage compiles its
# largest shape for the memory plan, then again at warm-up).
export CONFLUX_COMPILE_CACHE="${CONFLUX_COMPILE_CACHE:-/tmp/conflux_gpu_check_cache}"
exec > >(tee -a "$OUT_DIR/log.txt") 2>&1
echo "results: $OUT_DIR; budget ${budget} s"

share() {  # seconds for a stage: its share of the budget, never past what is left
    local want=$(( budget * $1 / 100 )) left=$(( budget - (SECONDS - start) - 15 ))
    (( want > left )) && want=$left
    (( want < 10 )) && want=10
    echo "$want"
}

python - <<'PY'
import jax, jaxlib, platform
print("python", platform.python_version(), "jax", jax.__version__, "jaxlib", jaxlib.__version__,
      "backend", jax.default_backend())
print(jax.devices(), [d.device_kind for d in jax.devices()])
PY
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader \
    2>/dev/null || true
if [ "$(python -c 'import jax; print(jax.default_backend())')" != "gpu" ]; then
    echo "no GPU backend: this check is meant for a GPU machine"
    exit 2
fi

# 1. The engine step on this device against the dense reference.
t=$(share 12); echo "== step ($t s)"
timeout -k 5 "$t" python bench/gpu_serve.py --stage step --json "$OUT_DIR/step.json"
step_rc=$?

# 2. Kernel correctness: the randomized and hand-picked checks of the CPU suite, against
# the compiled kernels (interpret mode is covered on CPU; skipping it saves minutes). The
# CPU-only FFI handlers are not this machine's business.
t=$(share 22); echo "== kernel tests ($t s)"
CONFLUX_KERNEL_TEST_IMPLS="xla,pallas" timeout -k 5 "$t" python -m pytest -q \
    -p no:cacheprovider -o addopts="" -rfE --timeout 60 \
    --ignore tests/pallas_kernels/test_cpu_attention.py \
    --ignore tests/pallas_kernels/test_cpu_gemm.py \
    tests/pallas_kernels >"$OUT_DIR/pytest.txt" 2>&1
tests_rc=$?
tail -n 25 "$OUT_DIR/pytest.txt"

# 3. Kernel timings: the ceilings, decode and prefill attention with a small tiling sweep.
t=$(share 18); echo "== kernel timings ($t s)"
timeout -k 5 "$t" python -m conflux_jax.bench kernels --json "$OUT_DIR/kernels.json" \
    --budget-s $(( t * 55 / 100 ))
bench_rc=$?

# 4. The serve benchmark: the rest of the budget.
t=$(share 100); echo "== serve ($t s)"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout -k 5 "$t" python bench/gpu_serve.py \
    --stage serve --json "$OUT_DIR/serve.json"
serve_rc=$?

python - "$OUT_DIR" "$step_rc" "$tests_rc" "$bench_rc" "$serve_rc" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
rcs = dict(zip(("step_rc", "kernel_tests_rc", "kernel_bench_rc", "serve_rc"),
               map(int, sys.argv[2:]), strict=True))

def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None

check = {**rcs, "step": (load("step.json") or {}).get("step"), "kernels": load("kernels.json"),
         "serve": (load("serve.json") or {}).get("serve")}
tail = (out / "pytest.txt").read_text().splitlines()[-1:] if (out / "pytest.txt").exists() else []
check["kernel_tests"] = tail
check["ok"] = all(v == 0 for v in rcs.values()) and bool(check["step"]) and \
    all(v.get("ok") for v in check["step"].values())
(out / "check.json").write_text(json.dumps(check, indent=2))
print("summary:", json.dumps(rcs), "ok =", check["ok"])
for key in ("memory", "latency_model", "serve", "decode_64"):
    if key in (check["serve"] or {}):
        print(key, json.dumps(check["serve"][key]))
PY
echo "elapsed $(( SECONDS - start )) s"
[ "$step_rc" -eq 0 ] && [ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$serve_rc" -eq 0 ]
