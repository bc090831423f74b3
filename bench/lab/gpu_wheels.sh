#!/usr/bin/env bash
# Downloads, on a machine that reaches PyPI, the wheels the GPU machine lacks (bench/lab/gpu_wheels.txt),
# built for that machine: CPython 3.12, manylinux x86-64.  Then carry DIR to the GPU machine and run
#   python3 bench/lab/gpu_bringup.py --wheels DIR --out OUT --pack
# Usage: bench/lab/gpu_wheels.sh [--dry-run] DIR
set -euo pipefail
dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
if [[ $# -ne 1 ]]; then
  echo "usage: bench/lab/gpu_wheels.sh [--dry-run] DIR" >&2
  exit 2
fi
dir=$1
list="$(dirname "$0")/gpu_wheels.txt"
mapfile -t reqs < <(grep -v '^[[:space:]]*#' "$list" | grep -v '^[[:space:]]*$')
cmd=(python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp
     --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
     -d "$dir" "${reqs[@]}")
if [[ $dry_run -eq 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
mkdir -p "$dir"
"${cmd[@]}"
ls -l "$dir"
