#!/usr/bin/env bash
# GPU check: engine-step and kernel correctness, kernel timings against the device's
# ceilings, and a short serve benchmark of Llama-3.1-8B-shaped random weights in bf16.
#
#   bash bench/gpu_check.sh [BUDGET_S [STAGES]]   # results under $OUT (or a fresh temp dir)
#
# STAGES: a comma-separated subset of step,tests,timings,serve (default: those four), for a
# rerun that skips what an earlier call already measured, and profile (bench/gpu_profile.py:
# a profiler trace of the 8B engine's decode and mixed steps, summarised).
#
# Installs and downloads nothing: needs jax with CUDA (the `gpu` extra), pytest,
# hypothesis, numpy, flax, tokenizers and this package importable (it runs from the
# checkout). The whole check ends within BUDGET_S seconds (default 420), so one device
# call of a 15-minute lease leaves room for a rerun; each stage has its own share and a
# stage that runs out is cut, not the check:
#   1. step     the whole engine step (compiled Pallas kernel inside) vs the dense
#               reference, fp32 and bf16, tiny random Llama                     <= 15%
#   2. kernels  tests/pallas_kernels against the compiled kernels              <= 35%
#   3. timings  copy bandwidth, bf16 matmul peak, decode / prefill attention (Pallas with
#               a small tiling sweep, and the jnp path beside it)               <= 18%
#   4. serve    8B-shaped bf16 weights, KV pool from --gpu-memory-utilization,
#               warm-up with calibration, one offline batch, 64-decode step     the rest
# Output (at most 8 files, as the device tool returns): log.txt (everything printed),
# check.json (every stage's result; "ok" = correctness passed and every stage ran),
# step.json, pytest.txt, kernels.json, serve.json (and profile.json).
# Exit status 0 when correctness passed and every stage ran; performance is reported
# (kernels.json meets_target_*, serve.json), not enforced.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT_DIR="${OUT:-$(mktemp -d /tmp/conflux_gpu_check.XXXXXX)}"
mkdir -p "$OUT_DIR"
budget=${1:-420}
stages=",${2:-step,tests,timings,serve},"
start=$SECONDS
# A fresh machine: keep compiles of one run in one cache (the serve stage compiles its
# largest shape for the memory plan, then again at warm-up).
export CONFLUX_COMPILE_CACHE="${CONFLUX_COMPILE_CACHE:-/tmp/conflux_gpu_check_cache}"
exec > >(tee -a "$OUT_DIR/log.txt") 2>&1
echo "results: $OUT_DIR; budget ${budget} s"

want() { [[ $stages == *",$1,"* ]]; }
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
step_rc=0 tests_rc=0 bench_rc=0 serve_rc=0
if want step; then
t=$(share 15); echo "== step ($t s)"
timeout -k 5 "$t" python bench/gpu_serve.py --stage step --json "$OUT_DIR/step.json"
step_rc=$?
fi

# 2. Kernel correctness: the randomized and hand-picked checks of the CPU suite, against
# the compiled kernels only (interpret mode and the jnp path are covered on CPU, and the
# jnp path is 30-100x slower on a GPU: GPU_CHECK_TEST_IMPLS=xla,pallas adds it). The
# CPU-only FFI handlers are not this machine's business.
# Three pytest runs, each under its own limit, so a kernel that never returns costs one run,
# not the rest: the hand-picked tests, then each randomized oracle test with every drawn
# example printed before it runs (the last one printed is the one that hung). A hang blocks
# the main thread inside the runtime, where pytest-timeout's signal never lands: its thread
# method dumps the stacks and ends the run instead.
if want tests; then
k=tests/pallas_kernels
# test_rpa_xla.py is the jnp path's alone (slow here, covered on CPU): not run.
files="$k/test_ragged_paged_attention.py $k/test_rpa_pallas.py $k/test_kv_write.py
       $k/test_rpa_reference.py"
tests_rc=0
for part in "15:not matches_oracle" "14:matches_oracle_f32" "6:matches_oracle_bf16"; do
    t=$(share "${part%%:*}"); echo "== kernel tests -k '${part#*:}' ($t s)"
    # shellcheck disable=SC2086
    CONFLUX_KERNEL_TEST_IMPLS="${GPU_CHECK_TEST_IMPLS:-pallas}" timeout -k 5 "$t" \
        python -m pytest -v -s -p no:cacheprovider -o addopts="" -rfE \
        --timeout 100 -o timeout_method=thread \
        --hypothesis-verbosity=verbose -k "${part#*:}" $files >>"$OUT_DIR/pytest.txt" 2>&1
    rc=$?; (( rc != 0 )) && tests_rc=$rc
    echo "exit $rc; $(grep -c ' PASSED' "$OUT_DIR/pytest.txt") passed so far"
    grep -E "FAILED|Error|^E " "$OUT_DIR/pytest.txt" | tail -n 8
done
tail -n 4 "$OUT_DIR/pytest.txt"
fi

if want timings; then
t=$(share 18); echo "== kernel timings ($t s)"
timeout -k 5 "$t" python -m conflux_jax.bench kernels --json "$OUT_DIR/kernels.json" \
    --budget-s $(( t * 55 / 100 ))
bench_rc=$?
fi

# 4. The serve benchmark: the rest of the budget.
if want serve; then
t=$(share 100); echo "== serve ($t s)"
XLA_PYTHON_CLIENT_MEM_FRACTION=0.92 timeout -k 5 "$t" python bench/gpu_serve.py \
    --stage serve --json "$OUT_DIR/serve.json"
serve_rc=$?
fi

# 5. Where the 8B steps' time goes (a profiler trace summarised on the device). Only when
# asked for: not part of the default check.
# One run per XLA flag variant, each with an equal share of what is left, merged into
# profile.json: as configured; with dynamic-slice fusion (the GEMMs may read each layer's
# weights in place instead of copying them out of the stacked arrays, ~5 ms of an 18 ms
# decode step in the first GPU run); with cuBLAS instead of Triton for the GEMMs (the
# slice fusion applies to library calls); and both.
if want profile; then
variants=("default:" "dsf:--xla_gpu_enable_dynamic_slice_fusion=true"
          "cublas:--xla_gpu_enable_triton_gemm=false"
          "dsf_cublas:--xla_gpu_enable_dynamic_slice_fusion=true --xla_gpu_enable_triton_gemm=false")
mkdir -p /tmp/conflux_profiles
for i in "${!variants[@]}"; do
    name=${variants[$i]%%:*} flags=${variants[$i]#*:}
    left=$(( budget - (SECONDS - start) - 15 )); t=$(( left / (${#variants[@]} - i) ))
    (( t < 10 )) && t=10
    echo "== profile $name: XLA_FLAGS+=$flags ($t s)"
    # XLA reads a blank XLA_FLAGS as a file name and aborts: set it only when non-blank.
    xla=$(echo "${XLA_FLAGS:-} $flags" | xargs)
    if [ -n "$xla" ]; then run=(env "XLA_FLAGS=$xla"); else run=(env -u XLA_FLAGS); fi
    "${run[@]}" timeout -k 5 "$t" \
        python bench/gpu_profile.py --json "/tmp/conflux_profiles/$name.json"
done
python - "$OUT_DIR/profile.json" "${variants[@]}" <<'PY'
import json, sys
from pathlib import Path
merged = {}
for v in sys.argv[2:]:
    name, flags = v.split(":", 1)
    f = Path(f"/tmp/conflux_profiles/{name}.json")
    merged[name] = {"xla_flags": flags, **(json.loads(f.read_text()) if f.exists() else {})}
Path(sys.argv[1]).write_text(json.dumps(merged, indent=2))
PY
fi

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
