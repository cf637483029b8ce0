#!/usr/bin/env bash
# Session-10 device runs (torch 2.11, triton 3.6 there), from the repository root, one `run` call each; results
# were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session10.sh a   # the Gluon history kernel (kernels/decode_gluon.py): its GPU tests, then all
#                                        # GPU kernel + StaticOscarCache tests; per-kernel profile of the op, Gluon
#                                        # (residency 9 / 12) against the Triton kernel (CONFIG gluon 0)
#   bash benchmarks/run_session10.sh diag   # scripts/gluon_diag.py: the Gluon kernel against the reference piece by
#                                           # piece (found run a's value-code pairing bug: a prmt selector nibble)
#   bash benchmarks/run_session10.sh b   # after the fix, with the next step's loads issued before each step's work:
#                                        # Gluon GPU tests, diagnostics, per-kernel profile (residency 9 / 12 / 16)
#   bash benchmarks/run_session10.sh c   # Gluon variants: prefetch on/off, one key MMA chain per plane, register cap
#                                        # 168 (12 programs per SM); ncu stall reasons of the Gluon kernel
#   bash benchmarks/run_session10.sh d   # run c's best as the default (no register prefetch, a key chain per plane,
#                                        # cap 168, 12 per SM) + L2 prefetch 1 / 2 / 4 steps ahead: Gluon GPU tests,
#                                        # per-kernel profile, ncu
#   bash benchmarks/run_session10.sh e   # the final tree (L2 prefetch 1 step ahead by default): all GPU kernel +
#                                        # StaticOscarCache tests, decode rows B=1,8,32 x 8K,32K,128K against BF16 SDPA
#   bash benchmarks/run_session10.sh f   # end to end: generate at B=8 / 32K (session 9's command)
#   bash benchmarks/run_session10.sh g   # the final tree (Gluon from 0.5 M history token-heads per call, CONFIG
#                                        # gluon_min_work): decode rows B=1,8,32 x 8K,32K,128K against BF16 SDPA
source benchmarks/device_env.sh
case "$1" in
a)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" -k gluon \
      --rootdir "$R" -x 2>&1 | tee "$OUT/tests_session10a_gluon.log" | tail -30
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon": 0}' '{"gluon_resident": 12}' '{"gluon_resident": 6}' \
      --out "$OUT/profile_op_h200_session10a.json" 2>&1 | grep -v "^ *$" | head -80
  ;;
esac
case "$1" in
diag)
  timeout 200 python3 "$R/scripts/gluon_diag.py" 2>&1 | tee "$OUT/gluon_diag_session10a.txt" | tail -60
  ;;
esac
case "$1" in
b)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" -k gluon \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session10b_gluon.log" | tail -5
  timeout 100 python3 "$R/scripts/gluon_diag.py" 2>&1 | tee "$OUT/gluon_diag_session10b.txt" | grep "random\|plane 0" | head -12
  timeout 240 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon": 0}' '{"gluon_resident": 12}' '{"gluon_resident": 16}' \
      --out "$OUT/profile_op_h200_session10b.json" 2>&1 | grep -E "^B=|_hist|_split"
  ;;
esac
ncu_hist() {
  timeout 150 ncu --clock-control none -k regex:_hist_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section LaunchStats --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 "$R/scripts/profile_split_kernel.py" \
    --config "$2" > "$1" 2>&1
  grep -E "Duration|Registers Per|Achieved Occ|Issued Warp|No Eligible|Active Warps Per|long_scoreboard|_wait_|_math_pipe|_mio|_short_score|Executed Instructions  |Memory Throughput|DRAM Throughput" \
      "$1" | head -24
}
case "$1" in
c)
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon_prefetch": 0, "gluon_splitk": 1, "gluon_maxnreg": 168, "gluon_resident": 12}' \
      '{"gluon_prefetch": 0, "gluon_splitk": 1, "gluon_maxnreg": 168, "gluon_resident": 24}' \
      '{"gluon_prefetch": 1, "gluon_splitk": 1, "gluon_resident": 16}' \
      '{"gluon_prefetch": 0, "gluon_splitk": 1, "gluon_resident": 16}' \
      '{"gluon_prefetch": 0, "gluon_splitk": 1, "gluon_maxnreg": 128, "gluon_resident": 16}' \
      '{"gluon_prefetch": 1, "gluon_splitk": 1, "gluon_maxnreg": 168, "gluon_resident": 24}' \
      --out "$OUT/profile_op_h200_session10c.json" 2>&1 | grep -E "^B=|_hist"
  ncu_hist "$OUT/ncu_hist_session10c.txt" '{"gluon_prefetch": 0, "gluon_splitk": 1, "gluon_maxnreg": 168, "gluon_resident": 12}'
  ;;
esac
case "$1" in
d)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" -k gluon \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session10d_gluon.log" | tail -3
  timeout 240 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon_l2pf": 1}' '{"gluon_l2pf": 2}' '{"gluon_l2pf": 4}' '{"gluon_l2pf": 2, "gluon_resident": 16}' \
      --out "$OUT/profile_op_h200_session10d.json" 2>&1 | grep -E "^B=|_hist"
  ncu_hist "$OUT/ncu_hist_session10d.txt" '{"gluon_l2pf": 2}'
  ;;
esac
case "$1" in
e)
  timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session10e.log" | tail -3
  timeout 330 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session10e.json" 2>&1 | tee "$OUT/bench_kernels_session10e.log" | tail -12
  ;;
f)
  timeout 420 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 \
      --methods bf16 oscar-static bf16-static --out "$OUT/generate_h200_b8_t32768_session10.json" 2>&1 \
      | tee "$OUT/bench_generate_session10.log" | grep -v "it/s" | tail -15
  ;;
esac
case "$1" in
g)
  timeout 330 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session10g.json" 2>&1 | tee "$OUT/bench_kernels_session10g.log" | tail -12
  ;;
esac
