#!/usr/bin/env bash
# Session-5 device runs (nvidia-h200 was lent: torch 2.11, triton 3.6), from the repository root,
# one `run` call each; results were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session5.sh a   # GPU kernel tests + Nsight Compute of the split kernel (rowdot, deferred)
#   bash benchmarks/run_session5.sh b   # kernel benchmark with the config sweeps (decode loops, write tiles)
#   bash benchmarks/run_session5.sh c   # GPU kernel tests again + the write path at its new default tile
#   bash benchmarks/run_session5.sh d   # with "deferred" the default: GPU kernel + StaticOscarCache tests, decode rows B=1,8 x 32K,128K
source benchmarks/device_env.sh
case "$1" in
a)
  python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" --rootdir "$R" 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
  for L in rowdot deferred; do  # B=8, T=128K, one warm launch of _split_kernel each
    timeout 150 ncu --clock-control none -k regex:_split_kernel --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section InstructionStats python3 "$R/scripts/profile_split_kernel.py" --loop $L >> "$OUT/ncu_split.txt" 2>&1
  done
  ;;
b)
  timeout 580 python3 "$R/scripts/bench_kernels.py" --sweep --out "$OUT/kernels_h200.json" 2>&1 | tee "$OUT/bench_kernels_h200.log"
  ;;
c)
  python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" --rootdir "$R" 2>&1 | tee "$OUT/gpu_tests_session5.log" | tail -3
  python3 "$R/scripts/bench_kernels.py" --batches 1 --lengths 8192 --out "$OUT/kernels_h200_write_default.json"
  ;;
d)
  python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" --rootdir "$R" 2>&1 \
      | tee "$OUT/gpu_tests_deferred_default.log" | tail -4
  python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8 --lengths 32768,131072 --out "$OUT/kernels_h200_deferred_default.json"
  ;;
esac
