#!/usr/bin/env bash
# Session-9 device runs (torch 2.11, triton 3.6 there), from the repository root, one `run` call each; results
# were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session9.sh a   # occupancy: the split kernel under a ptxas register cap (CONFIG["maxnreg"]
#                                       # 168 / 128 = 3 / 4 programs per SM, resident_programs to match) against the
#                                       # default (255 registers, 2 per SM): per-kernel profile, ncu stall reasons
#   bash benchmarks/run_session9.sh b   # the deferred loop's code tiles software-pipelined again under Triton 3.6
#                                       # (meta_ahead had made their addresses loop-carried: no asynchronous copies):
#                                       # per-kernel profile over register cap / stages / L2 prefetch, ncu stalls
#   bash benchmarks/run_session9.sh c   # code extraction in inline PTX (CONFIG["asm_codes"]) and the session's new
#                                       # defaults: GPU kernel + StaticOscarCache tests, per-kernel profile, ncu
#   bash benchmarks/run_session9.sh d   # (at commit 3d0e65d, which has it; removed after this run since it lost) values
#                                       # transposed (CONFIG["v_trans"]: the group's two code planes as the A operand
#                                       # of one wgmma, p s as its B operand): GPU tests, per-kernel profile
#   bash benchmarks/run_session9.sh e   # the final tree: GPU kernel + StaticOscarCache tests, decode rows B=1,8,32 x
#                                       # 8K,32K,128K against BF16 SDPA (CUDA graphs), per-kernel profile of the op
#   bash benchmarks/run_session9.sh f   # the logit epilogue as fused multiply-adds and the reference phi folded into
#                                       # the row offset: GPU tests, per-kernel profile, ncu instruction count
#   bash benchmarks/run_session9.sh g   # the final tree's decode rows B=1,8,32 x 8K,32K,128K against BF16 SDPA
#   bash benchmarks/run_session9.sh h   # end to end on the final tree: generate at B=8 / 32K (session 4's command,
#                                       # without the eager OSCAR row), BF16 DynamicCache / StaticCache vs StaticOscarCache
source benchmarks/device_env.sh
# Nsight Compute stall reasons, issue rate and occupancy of the split kernel (deferred loop, B=8/128K) under a CONFIG
ncu_split() {
  timeout 150 ncu --clock-control none -k regex:_split_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section LaunchStats --section InstructionStats \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 "$R/scripts/profile_split_kernel.py" \
    --loop deferred --config "$2" > "$1" 2>&1
  grep -E "Duration|Registers Per|Achieved Occ|Issued Warp|No Eligible|Active Warps Per|long_scoreboard|_wait_|Executed Instructions  " \
      "$1" | head -20
}
case "$1" in
a)
  timeout 330 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"maxnreg": 168, "resident_programs": 3}' '{"maxnreg": 128, "resident_programs": 4}' \
      '{"maxnreg": 168, "resident_programs": 3, "num_stages": 3}' '{"maxnreg": 128, "resident_programs": 4, "num_stages": 3}' \
      '{"maxnreg": 168, "resident_programs": 3, "meta_ahead": false}' '{"maxnreg": 168, "resident_programs": 2}' \
      '{"maxnreg": 128, "resident_programs": 4, "prefetch": 0}' \
      --out "$OUT/profile_op_h200_session9a.json" 2>&1 | grep -E "^B=|split"
  ncu_split "$OUT/ncu_split_session9a.txt" '{"maxnreg": 168, "resident_programs": 3}'
  ;;
b)
  timeout 360 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"maxnreg": 168, "resident_programs": 3}' '{"maxnreg": 168, "resident_programs": 3, "num_stages": 3}' \
      '{"maxnreg": 168, "resident_programs": 3, "prefetch": 0}' '{"maxnreg": 168, "resident_programs": 3, "prefetch": 2}' \
      '{"prefetch": 0}' '{"meta_ahead": false}' '{"maxnreg": 168, "resident_programs": 3, "meta_ahead": false}' \
      '{"num_stages": 3}' \
      --out "$OUT/profile_op_h200_session9b.json" 2>&1 | grep -E "^B=|split"
  ncu_split "$OUT/ncu_split_session9b.txt" '{"maxnreg": 168, "resident_programs": 3}'
  ;;
c)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session9c.log" | tail -3
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"asm_codes": 0}' '{"pair_meta": true}' '{"num_stages": 3}' \
      '{"maxnreg": null, "resident_programs": 2}' '{"prefetch": 2}' \
      --out "$OUT/profile_op_h200_session9c.json" 2>&1 | grep -E "^B=|split"
  ncu_split "$OUT/ncu_split_session9c.txt" '{}'
  ;;
d)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" -k "vt or asm" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session9d.log" | tail -3
  timeout 240 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"v_trans": 1}' '{"v_trans": 1, "num_stages": 3}' '{"v_trans": 1, "asm_codes": 0}' \
      --out "$OUT/profile_op_h200_session9d.json" 2>&1 | grep -E "^B=|split"
  ;;
e)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session9e.log" | tail -3
  timeout 330 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session9.json" 2>&1 | tee "$OUT/bench_kernels_session9.log" | tail -12
  timeout 60 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,1x8192 --iters 10 \
      --configs '{}' --out "$OUT/profile_op_h200_session9e.json" 2>&1 | grep -E "^B=|split|combine|rotate"
  ;;
f)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session9f.log" | tail -3
  timeout 120 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' --out "$OUT/profile_op_h200_session9f.json" 2>&1 | grep -E "^B=|split"
  ncu_split "$OUT/ncu_split_session9f.txt" '{}'
  ;;
g)
  timeout 330 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session9g.json" 2>&1 | tee "$OUT/bench_kernels_session9g.log" | tail -12
  ;;
h)
  timeout 420 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 \
      --methods bf16 oscar-static bf16-static --out "$OUT/generate_h200_b8_t32768_session9.json" 2>&1 \
      | tee "$OUT/bench_generate_session9.log" | grep -v "it/s" | tail -15
  ;;
esac
