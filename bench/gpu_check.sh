#!/usr/bin/env bash
# GPU check: kernel and step correctness, kernel timings against the device's ceilings, and
# a short serve benchmark of Llama-3.1-8B-shaped random weights in bf16. One JSON out.
#
#   bash bench/gpu_check.sh          # results under $OUT (or a fresh temp dir)
#
# Installs and downloads nothing: needs jax with CUDA (the `gpu` extra), pytest,
# hypothesis, numpy and this package importable. Fits a 15-minute device slot: kernel
# tests <= 150 s, kernel timings <= 120 s, step check + serve benchmark <= 420 s.
# Output: check.json (every stage's result; "ok" = tests passed and every stage ran), and
# per stage env.txt, pytest.txt, bench.txt / kernels.json, serve.txt / serve.json.
# Exit status 0 when correctness passed and every stage ran; performance is reported
# (kernels.json meets_target_*, serve.json), not enforced.
set -uo pipefail

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT_DIR="${OUT:-$(mktemp -d /tmp/conflux_gpu_check.XXXXXX)}"
mkdir -p "$OUT_DIR"
echo "results: $OUT_DIR"

python - <<'PY' 2>&1 | tee "$OUT_DIR/env.txt"
import jax, jaxlib
print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "backend", jax.default_backend())
print(jax.devices(), [d.device_kind for d in jax.devices()])
PY
if [ "$(python -c 'import jax; print(jax.default_backend())')" != "gpu" ]; then
    echo "no GPU backend: this check is meant for a GPU machine" | tee -a "$OUT_DIR/env.txt"
    exit 2
fi

# 1. Kernel correctness: the randomized and hand-picked checks of the CPU suite, against
# the compiled kernels (interpret mode is covered on CPU; skipping it saves minutes).
export CONFLUX_KERNEL_TEST_IMPLS="xla,pallas"
timeout 150 python -m pytest -q -p no:cacheprovider -o addopts="" -rfE -x \
    --junitxml="$OUT_DIR/pytest.xml" tests/pallas_kernels 2>&1 | tee "$OUT_DIR/pytest.txt"
tests_rc=${PIPESTATUS[0]}
unset CONFLUX_KERNEL_TEST_IMPLS

# 2. Kernel timings: the ceilings (copy bandwidth, bf16 matmul peak), decode and prefill
# attention with a small tiling sweep.
timeout 120 python -m conflux_jax.bench kernels --json "$OUT_DIR/kernels.json" --budget-s 70 \
    2>&1 | tee "$OUT_DIR/bench.txt"
bench_rc=${PIPESTATUS[0]}

# 3. Step correctness (the whole engine step with the compiled kernel vs the dense
# reference, fp32 and bf16), then the serve benchmark: 8B-shaped random bf16 weights, the
# KV pool sized from device memory, warm-up with calibration, one batch of 64 requests.
timeout 420 python bench/gpu_serve.py --stage all --json "$OUT_DIR/serve.json" \
    2>&1 | tee "$OUT_DIR/serve.txt"
serve_rc=${PIPESTATUS[0]}

python - "$OUT_DIR" "$tests_rc" "$bench_rc" "$serve_rc" <<'PY' | tee "$OUT_DIR/summary.txt"
import json, sys
from pathlib import Path

out, tests_rc, bench_rc, serve_rc = Path(sys.argv[1]), *map(int, sys.argv[2:])

def load(name):
    p = out / name
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None

env = (out / "env.txt").read_text().splitlines()
check = {"env": env, "kernel_tests_rc": tests_rc, "kernel_bench_rc": bench_rc,
         "serve_rc": serve_rc, "kernels": load("kernels.json"), "serve": load("serve.json")}
step = (check["serve"] or {}).get("step") or {}
check["ok"] = tests_rc == 0 and bench_rc == 0 and serve_rc == 0 and \
    bool(step) and all(v.get("ok") for v in step.values())
(out / "check.json").write_text(json.dumps(check, indent=2))
print(f"kernel tests exit {tests_rc}, kernel bench exit {bench_rc}, step+serve exit "
      f"{serve_rc}; ok={check['ok']}; {out / 'check.json'}")
serve = (check["serve"] or {}).get("serve") or {}
for key in ("memory", "latency_model", "serve", "decode_64"):
    if key in serve:
        print(key, json.dumps(serve[key]))
PY
grep -E "^(ceilings|decode|prefill|write_kv)" "$OUT_DIR/bench.txt" >>"$OUT_DIR/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$serve_rc" -eq 0 ]
