#!/usr/bin/env bash
# Session-7 device runs (torch 2.11, triton 3.6 there), from the repository root, one `run` call each; results
# were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session7.sh a   # query-row tile 8 (CONFIG["m_pad_min"]; the default during this run, 16 again after it) vs 16: GPU kernel +
#                                       # StaticOscarCache tests, per-kernel profile of the op, sweep, decode rows
#   bash benchmarks/run_session7.sh b   # final tree (query prologue kernel, one-pass combine, shift-free value codes):
#                                       # GPU kernel + StaticOscarCache tests, per-kernel profile, decode rows
#   bash benchmarks/run_session7.sh c   # b with the query prologue on tf32x3 tensor cores, split over channel blocks
#                                       # (b's float32 FMA dot took 58 us): the same tests, profile and decode rows
#   bash benchmarks/run_session7.sh d   # final tree (the benchmark's rotations contiguous, as the cache holds them:
#                                       # c's rows include two 2.5 us copies of R): profile + decode rows
#   bash benchmarks/run_session7.sh e   # the reviewed tree (window splits merged in one pass): tests, profile, rows
source benchmarks/device_env.sh
# GPU kernel + StaticOscarCache tests (log tests_session7$1.log, unless $1 is empty), the per-kernel profile and the
# decode rows B=1,8,32 x 8K,32K,128K; $2: the name of the result files
final_rows() {
  [ -n "$1" ] && timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session7$1.log" | tail -3
  timeout 60 python3 "$R/scripts/profile_decode_op.py" --points 1x8192,1x131072,8x131072 \
      --out "$OUT/profile_op_h200_final.json" 2>&1 | tail -24
  timeout 320 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_$2.json" 2>&1 | tee "$OUT/bench_kernels_$2.log" | tail -12
}
case "$1" in
a)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session7a.log" | tail -3
  timeout 120 python3 "$R/scripts/profile_decode_op.py" --points 1x8192,1x131072,8x131072 \
      --configs '{"m_pad_min": 16}' '{"m_pad_min": 8}' --out "$OUT/profile_op_h200.json" 2>&1 | tail -40
  timeout 260 python3 "$R/scripts/bench_kernels.py" --sweep --sweep-set mpad --no-write --batches 1,8 \
      --lengths 32768,131072 --out "$OUT/kernels_h200_mpad.json" 2>&1 | tee "$OUT/bench_kernels_mpad.log" \
      | grep -E "sweep|config|^ *[0-9]"
  ;;
b)
  final_rows b session7
  ;;
c)
  final_rows c session7
  ;;
d)
  final_rows "" session7_final
  ;;
e)
  final_rows e session7_review
  ;;
esac
