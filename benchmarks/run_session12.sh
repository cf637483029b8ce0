#!/usr/bin/env bash
# Session-12 device runs (torch 2.11, triton 3.6 there), from the repository root, one `run` call each; results
# were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session12.sh a   # the Gluon history kernel's peeled loop (gluon_peel: the first step is the
#                                        # reference step, full steps without masks from one address per lane, a masked
#                                        # last step) and W's block diagonal by one `and` per register: Gluon GPU tests,
#                                        # per-kernel profile against the one-loop kernel and register caps, Nsight
#                                        # Compute of the history kernel at B=8/128K
#   bash benchmarks/run_session12.sh b   # the peeled loop's full steps through a cp.async shared-memory pipeline
#                                        # (gluon_stages 2 / 4): Gluon GPU tests over every loop variant, per-kernel
#                                        # profile, Nsight Compute of the 4-stage kernel at B=8/128K
#   bash benchmarks/run_session12.sh c   # copies without predicates (past the last full step they repeat it), the 1-warp
#                                        # loop without the one-loop variant, a skewed 4-stage loop (gluon_skew: the next
#                                        # step's logits beside this step's values): Gluon GPU tests over every variant,
#                                        # per-kernel profile
source benchmarks/device_env.sh
ncu_hist() {
  timeout 150 ncu --clock-control none -k regex:_hist_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section LaunchStats --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 "$R/scripts/profile_split_kernel.py" \
    --config "$2" > "$1" 2>&1
  grep -E "Duration|Registers Per|Achieved Occ|Issued Warp|No Eligible|Active Warps Per|long_scoreboard|_wait_|_math_pipe|_mio|_short_score|_lg_throttle|Executed Instructions  |Memory Throughput|DRAM Throughput" \
      "$1" | head -24
}
case "$1" in
a)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon" --rootdir "$R" 2>&1 | tee "$OUT/tests_session12a.log" | tail -6
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon_peel": 0}' '{"gluon_l2pf": 2}' '{"gluon_maxnreg": 144, "gluon_resident": 14}' \
      '{"gluon_maxnreg": 152, "gluon_resident": 13}' \
      --out "$OUT/profile_op_h200_session12a.json" 2>&1 | grep -E "^B=|_hist|graph"
  ncu_hist "$OUT/ncu_hist_session12a.txt" '{"pdl": 0}'
  ;;
esac
case "$1" in
b)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon" --rootdir "$R" 2>&1 | tee "$OUT/tests_session12b.log" | tail -6
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon_stages": 2}' '{"gluon_stages": 4}' \
      --out "$OUT/profile_op_h200_session12b.json" 2>&1 | grep -E "^B=|_hist|graph"
  ncu_hist "$OUT/ncu_hist_session12b.txt" '{"pdl": 0, "gluon_stages": 4}'
  ;;
esac
case "$1" in
c)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon" --rootdir "$R" 2>&1 | tee "$OUT/tests_session12c.log" | tail -6
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon_stages": 4}' '{"gluon_stages": 4, "gluon_skew": 1}' '{"gluon_stages": 0}' \
      --out "$OUT/profile_op_h200_session12c.json" 2>&1 | grep -E "^B=|_hist|graph"
  ;;
esac
