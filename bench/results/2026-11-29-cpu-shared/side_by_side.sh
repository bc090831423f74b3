#!/bin/bash
# ringleader's gateway and llama.cpp's server on the same GGUF file, one after the other on this
# machine, each quiet and beside 1 and 2 busy processes (ringleader bench --cpu-interference 1,2).
#   side_by_side.sh OUTDIR ISA LLAMA_VENV
# ISA avx2: ringleader's kernels built without AVX-512 (RINGLEADER_CPU_ISA=avx2) and torch's
# dispatch held to AVX2 (ATEN_CPU_CAPABILITY=avx2), against a llama.cpp built AVX2-only
# (GGML_NATIVE=OFF, GGML_AVX512=OFF): what an AVX2-only machine runs. ISA native: both at their best.
set -u
OUT=$1; ISA=$2; LLAMA=$3
mkdir -p "$OUT"
. /work/main/.venv/bin/activate
M=$(python -m ringleader.bench.smollm2)
LOAD=(--model "$M" --http-prompt-text --concurrency 1,8 --requests 8,16 --input-len 64 --output-len 64
      --ignore-eos --warmup 2 --cpu-interference 1,2 --no-plots)
wait_http() { for _ in $(seq 120); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }

env_isa=()
[ "$ISA" = avx2 ] && env_isa=(RINGLEADER_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
env "${env_isa[@]}" ringleader serve --model "$M" --bind tcp://127.0.0.1:5711 --http 127.0.0.1:8711 2>"$OUT/ringleader.serve.log" &
RP=$!
wait_http http://127.0.0.1:8711 || { echo "ringleader did not start"; kill $RP; exit 1; }
ringleader bench --http http://127.0.0.1:8711 "${LOAD[@]}" --out "$OUT/ringleader" 2>&1 | tee "$OUT/ringleader.console.txt" | grep -E "c=[0-9]|x0|x1"
kill -INT $RP; wait $RP

"$LLAMA/bin/python" -m llama_cpp.server --model "$M" --n_threads 2 --n_threads_batch 2 --n_ctx 2048 \
  --interrupt_requests False --port 8712 2>"$OUT/llamacpp.serve.log" >/dev/null &
LP=$!
wait_http http://127.0.0.1:8712 || { echo "llama.cpp did not start"; kill $LP; exit 1; }
ringleader bench --http http://127.0.0.1:8712 --http-min-tokens "${LOAD[@]}" --out "$OUT/llamacpp" 2>&1 | tee "$OUT/llamacpp.console.txt" | grep -E "c=[0-9]|x0|x1"
kill -INT $LP; wait $LP
