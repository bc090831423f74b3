#!/bin/bash
# Before/after of priority-aware preemption, alternating: run from the repo root of each
# revision (BEFORE: a git worktree of the parent commit), each imported from its own tree.  Prints one JSON line per run.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BEFORE=${BEFORE:-/tmp/before}
AFTER=${AFTER:-$(cd "$HERE/../../.." && pwd)}
PORT=5631
for run in 1 2 3; do
  for side in before after; do
    dir=$BEFORE; [ $side = after ] && dir=$AFTER
    (cd "$dir" && PYTHONPATH="$dir" exec python -m ringleader.hostctl.cli serve --model tiny --max-ctx 512 \
      --kv-cache-memory 2MiB --policy priority --bind tcp://127.0.0.1:$PORT) > "$HERE/$side-$run.serve.log" 2>&1 &
    server=$!
    ringleader wait-ready --connect tcp://127.0.0.1:$PORT --quiet
    echo "{\"side\": \"$side\", \"run\": $run, \"result\": $(cd "$dir" && PYTHONPATH="$dir" python "$HERE/priority_load.py" tcp://127.0.0.1:$PORT)}"
    kill -INT $server; wait $server || true
  done
done
