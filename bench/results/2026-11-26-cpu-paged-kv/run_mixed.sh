#!/usr/bin/env bash
# Issue 28: the same 32 MiB of KV cache (tiny preset, fp32: 2 KiB a token), before (per-slot cache:
# 16 slots x 1024 tokens, rev 20e5600 checked out at $BEFORE) and after (a page pool of 32 MiB,
# 128 slots), one server at a time, alternating, under the same long-tailed mixed-length load.
# Each run: `ringleader bench --connect` and bench/running_sampler.py beside it.
set -euo pipefail
BEFORE=${BEFORE:-/tmp/before}
OUT=$(cd "${OUT:-$(dirname "$0")}" && pwd)
LOAD=(--concurrency 64 --requests 256 --input-len 192 --output-len 96 --length-dist longtail
      --ignore-eos --warmup 4 --max-ctx 1024 --no-plots --quiet)
run() {  # name, repo, serve flags...
  local name=$1 repo=$2; shift 2
  (cd "$repo" && PYTHONPATH="$repo" exec python -m ringleader.hostctl.cli serve --model tiny --max-ctx 1024 \
      --bind tcp://127.0.0.1:5611 "$@" >"$OUT/$name.serve.log" 2>&1) &
  local pid=$!
  python -m ringleader.hostctl.cli wait-ready --connect tcp://127.0.0.1:5611 --timeout 120 --quiet
  python -m ringleader.bench.running_sampler tcp://127.0.0.1:5611 --duration 600 --interval 0.1 \
      --json "$OUT/$name.running.json" >/dev/null &
  local sampler=$!
  python -m ringleader.hostctl.cli bench --connect tcp://127.0.0.1:5611 "${LOAD[@]}" --json "$OUT/$name.bench.json"
  kill -INT $pid; wait $pid || true; wait $sampler || true
}
for i in ${RUNS:-1 2}; do
  run "before-$i" "$BEFORE" --slots 16
  run "after-$i" "$(cd "$OUT/../../.." && pwd)" --kv-cache-memory 32MiB
done
