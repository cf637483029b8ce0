#!/usr/bin/env bash
# Session-8 device runs (torch 2.11, triton 3.6 there), from the repository root, one `run` call each; results
# were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session8.sh a   # the "stacked" history loop (kernels/decode_stacked.py) against the deferred
#                                       # default: its GPU tests, per-kernel profile of the op over tile configs,
#                                       # Nsight Compute stall reasons of both loops at B=8/128K
source benchmarks/device_env.sh
STK='{"loop": "stacked", "block_n": 256, "num_stages": 2}'
case "$1" in
a)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" -k stacked \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session8a.log" | tail -3
  timeout 240 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072 --iters 10 --configs '{}' \
      "$STK" '{"loop": "stacked", "block_n": 256, "num_stages": 3}' \
      '{"loop": "stacked", "block_n": 256, "num_stages": 2, "programs_per_sm": 2}' \
      '{"loop": "stacked", "stack_mp_min": 8, "block_n": 128, "num_stages": 2}' \
      '{"loop": "stacked", "stack_mp_min": 8, "block_n": 128, "num_stages": 4}' \
      '{"loop": "stacked", "block_n": 64}' \
      '{"m_pad_min": 8, "programs_per_sm": 8}' \
      --out "$OUT/profile_op_h200_session8a.json" 2>&1 | grep -E "^B=|split" 
  for L in deferred stacked; do
    cfg='{}'; [ $L = stacked ] && cfg="$STK"
    timeout 100 ncu --clock-control none -k regex:_split_kernel --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
      --section LaunchStats --section InstructionStats \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 "$R/scripts/profile_split_kernel.py" --loop $L \
      --config "$cfg" >> "$OUT/ncu_split_session8.txt" 2>&1
  done
  grep -E "Duration|Registers Per|Achieved Occ|Issued Warp|No Eligible|Active Warps Per|issue_stalled|Executed Instructions  " \
      "$OUT/ncu_split_session8.txt" | head -40
  ;;
esac
