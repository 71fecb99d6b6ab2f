#!/usr/bin/env bash
# `bench serve` against the Ray Serve app (issue 18): two default-model instances behind
# each router in turn, the same 4-turn chat replay. Needs `pip install .[ray]`.
#   bash bench/serve_ray_routers.sh [OUT_DIR]
# Writes OUT_DIR/ray_<router>.json (bench serve's JSON) and prints the summed prefix
# counters from the ingress's /metrics after each run.
set -euo pipefail
PY=${PYTHON:-python}
OUT=${1:-.}
PORT=${PORT:-8011}
mkdir -p "$OUT"
for router in conflux round-robin; do
  $PY -m serving.ray_app --instances 2 --model default --router "$router" --port "$PORT" \
      --max-model-len 1024 > "$OUT/ray_app_$router.log" 2>&1 &
  app=$!
  for _ in $(seq 1 300); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && break
    sleep 2
  done
  $PY -m conflux_jax.bench serve --url "http://127.0.0.1:$PORT" --trace conversation \
      --turns 4 --num-prompts 16 --rates 0.25 --prompt-scale 0.0625 --max-prompt-len 512 \
      --max-turn-prompt-len 32 --max-model-len 1024 --json "$OUT/ray_$router.json" | tail -3
  echo "router $router:"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^vllm:prefix_cache_(queries|hits)_total"
  kill -INT "$app"
  wait "$app" || true
  ray stop --force > /dev/null 2>&1 || true
done
