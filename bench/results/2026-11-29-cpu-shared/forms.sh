#!/bin/bash
# ringleader's quantized and fp32 forms of the same GGUF file in one bench run (1, 8, 16 streams),
# quiet and beside one busy process.   forms.sh OUTDIR ISA   (ISA avx2: what an AVX2-only machine
# runs: our kernels without AVX-512, torch/MKL/oneDNN dispatch held to AVX2; native: this CPU's best)
set -u
OUT=$1; ISA=$2
. /work/main/.venv/bin/activate
M=$(python -m ringleader.bench.smollm2)
env_isa=()
[ "$ISA" = avx2 ] && env_isa=(RINGLEADER_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2)
env "${env_isa[@]}" ringleader bench --model "$M" --compare host:quantized,host:fp32 --server-arg=--no-prefix-caching \
  --concurrency 1,8,16 --requests 8,16,32 --input-len 64 --output-len 64 --ignore-eos --warmup 4 \
  --cpu-interference 1 --no-plots --out "$OUT" 2>&1 | tee "$OUT.console.txt" | grep -E "^host|busy:"
