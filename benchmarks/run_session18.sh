#!/usr/bin/env bash
# Session-18 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session18.sh a   # the history kernel's access pattern without its arithmetic (the read floor
#                                        # over its grid and its six streams, and over two denser layouts of the same
#                                        # bytes), and the combine with 2 / 4 / 8 programs a row (merge_csplit)
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  timeout 200 python3 "$R/scripts/bench_read_floor.py" --batches 8,1 --length 131072 --pattern \
      --out "$OUT/read_floor_${GPU}_session18a.json" 2>&1 | grep -v Warn
  timeout 350 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768,8x8192 --iters 20 \
      --configs '{}' '{"merge_csplit": 2}' '{"merge_cblock": 32, "merge_csplit": 4}' \
      '{"merge_cblock": 16, "merge_csplit": 8}' '{"merge_cblock": 32, "merge_csplit": 4, "merge_warps": 2}' \
      --out "$OUT/profile_op_${GPU}_session18a.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
