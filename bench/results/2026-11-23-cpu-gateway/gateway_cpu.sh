#!/bin/bash
# usage: gwcpu.sh LABEL ; measures standalone gateway CPU per 1k tokens at c=32 and c=8
. /work/main/.venv/bin/activate
cd /tmp
ringleader serve --model tiny --bind tcp://127.0.0.1:5602 2>/tmp/s2.err &
SP=$!
sleep 6
ringleader gateway --upstream tcp://127.0.0.1:5602 --listen 127.0.0.1:8602 2>/tmp/g2.err &
GP=$!
sleep 3
cpu() { awk '{print ($14+$15)/100}' /proc/$1/stat; }
for c in 8 32; do
  before=$(cpu $GP)
  out=$(ringleader bench --http http://127.0.0.1:8602 --concurrency $c --requests 128 --input-len 32 --output-len 64 --ignore-eos --no-plots --quiet --warmup 8 2>&1 | grep "^http")
  after=$(cpu $GP)
  echo "$1 c=$c gateway_cpu_s=$(echo "$after - $before" | bc) per_1k_tok=$(echo "scale=4; ($after - $before)*1000/(128*64)" | bc) :: $out"
done
kill -INT $GP; sleep 2; kill -TERM $SP; wait
