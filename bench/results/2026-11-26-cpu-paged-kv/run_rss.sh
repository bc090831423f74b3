#!/usr/bin/env bash
# Issue 28: resident memory of `ringleader serve --model <SmolLM2-135M GGUF>` with every default,
# before (rev 20e5600 checked out at $BEFORE: 32 slots x 2048 positions of per-slot KV cache) and
# after (a 512 MiB page pool, 128 slots): VmRSS once ready, and after 8 chat requests.
set -euo pipefail
BEFORE=${BEFORE:-/tmp/before}
OUT=$(cd "${OUT:-$(dirname "$0")}" && pwd)
AFTER=$(cd "$OUT/../../.." && pwd)
GGUF=$(python -m ringleader.bench.smollm2 | tail -1)
measure() {  # name, repo
  local name=$1 repo=$2
  (cd "$repo" && PYTHONPATH="$repo" exec python -m ringleader.hostctl.cli serve --model "$GGUF" \
      --bind tcp://127.0.0.1:5612 >"$OUT/$name.rss-serve.log" 2>&1) &
  local pid=$!
  python -m ringleader.hostctl.cli wait-ready --connect tcp://127.0.0.1:5612 --timeout 300 --quiet
  local ready; ready=$(awk '/VmRSS/{print $2}' /proc/$pid/status)
  for i in 1 2 3 4 5 6 7 8; do
    python -m ringleader.hostctl.cli generate --connect tcp://127.0.0.1:5612 --max-tokens 32 \
        "Tell me about the number $i." >/dev/null &
  done
  wait $(jobs -p | grep -v "^$pid$") 2>/dev/null || true
  local busy hwm; busy=$(awk '/VmRSS/{print $2}' /proc/$pid/status); hwm=$(awk '/VmHWM/{print $2}' /proc/$pid/status)
  echo "{\"name\": \"$name\", \"rss_ready_mib\": $((ready / 1024)), \"rss_after_requests_mib\": $((busy / 1024)), \"rss_peak_mib\": $((hwm / 1024))}" | tee "$OUT/$name.rss.json"
  kill -INT $pid; wait $pid || true
}
measure before "$BEFORE"
measure after "$AFTER"
