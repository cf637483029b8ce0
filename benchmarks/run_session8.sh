#!/usr/bin/env bash
# Session-8 device runs (torch 2.11, triton 3.6 there), from the repository root, one `run` call each; results
# were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session8.sh a   # (at commit 5ab8b33, which has it; removed after this run since it lost everywhere)
#                                       # the "stacked" history loop (kernels/decode_stacked.py) against the deferred
#                                       # default: its GPU tests, per-kernel profile of the op over tile configs,
#                                       # Nsight Compute stall reasons of both loops at B=8/128K
#   bash benchmarks/run_session8.sh b   # the deferred loop with each block's scale/zero loaded one iteration ahead
#                                       # (CONFIG["meta_ahead"]): its GPU tests, per-kernel profile against the default
#                                       # and the paired loads, ncu stall reasons at B=8/128K
#   bash benchmarks/run_session8.sh c   # meta_ahead the default: GPU kernel + StaticOscarCache tests, b's profile
#                                       # again (b's files did not come back), tiles around the new default, ncu
#                                       # per-instruction stall samples of the split kernel (SASS of Triton 3.6)
#   bash benchmarks/run_session8.sh d   # the wave model of num_splits the default: GPU kernel + StaticOscarCache tests,
#                                       # per-kernel profile against the old split rule, decode rows B=1,8,32 x 8K,32K,128K
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
b)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" -k "ahead" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session8b.log" | tail -3
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,1x8192 --iters 10 \
      --configs '{}' '{"meta_ahead": true}' '{"meta_ahead": true, "pair_meta": true}' '{"pair_meta": true}' \
      '{"meta_ahead": true, "prefetch": 2}' '{"meta_ahead": true, "pair_meta": true, "prefetch": 8}' \
      '{"meta_ahead": true, "pair_meta": true, "num_stages": 3}' \
      --out "$OUT/profile_op_h200_session8b.json" 2>&1 | grep -E "^B=|split"
  timeout 100 ncu --clock-control none -k regex:_split_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section LaunchStats --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 "$R/scripts/profile_split_kernel.py" \
    --loop deferred --config '{"meta_ahead": true, "pair_meta": true}' > "$OUT/ncu_split_session8b.txt" 2>&1
  grep -E "Duration|Registers Per|Issued Warp|No Eligible|Active Warps Per|long_scoreboard|_wait_|Executed Instructions  " \
      "$OUT/ncu_split_session8b.txt" | head -20
  ;;
c)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session8c.log" | tail -3
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768 --iters 10 \
      --configs '{"meta_ahead": false}' '{}' '{"meta_ahead": true, "pair_meta": true}' '{"prefetch": 2}' \
      '{"num_stages": 3}' '{"programs_per_sm": 8}' '{"programs_per_sm": 2}' \
      --out "$OUT/profile_op_h200_session8c.json" 2>&1 | grep -E "^B=|split"
  timeout 150 ncu --clock-control none -k regex:_split_kernel --launch-skip 3 --launch-count 1 \
    --section SchedulerStats --section WarpStateStats --section SourceCounters --page source --print-source sass \
    python3 "$R/scripts/profile_split_kernel.py" --loop deferred > "$OUT/ncu_source_session8c.txt" 2>&1
  tail -c 600 "$OUT/ncu_source_session8c.txt"; wc -l "$OUT/ncu_source_session8c.txt"
  ;;
d)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session8d.log" | tail -3
  timeout 120 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{"programs_per_sm": 4}' '{}' --out "$OUT/profile_op_h200_session8d.json" 2>&1 | grep -E "^B=|split"
  timeout 330 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session8.json" 2>&1 | tee "$OUT/bench_kernels_session8.log" | tail -12
  ;;
esac
