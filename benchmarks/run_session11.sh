#!/usr/bin/env bash
# Session-11 device runs (torch 2.11, triton 3.6 there), from the repository root, one `run` call each; results
# were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session11.sh a   # one-round combine (rows per program, history + window in one pass), window
#                                        # programs of 32 tokens with K and V loaded together, the Gluon kernel's
#                                        # group-sum offset (gluon_gsum): Gluon + real-shape GPU tests, then the
#                                        # per-kernel profile of the op against the previous choices
#   bash benchmarks/run_session11.sh b   # run a's combine reverted (slower: one round of loads did not pay), window
#                                        # launch without the history branch (75 registers, pipelined), programmatic
#                                        # dependent launch of the Gluon path: all GPU kernel + StaticOscarCache tests,
#                                        # then the per-kernel profile (pdl / gsum / window variants)
#   bash benchmarks/run_session11.sh c   # Nsight Compute of the combine kernel (B=1/128K, B=32/32K; no PDL, so that its
#                                        # time is its own), and the op's profile over the combine's merge block
#   bash benchmarks/run_session11.sh d   # the combine's merge block / warps / un-rotation chunk: per-kernel profile
#   bash benchmarks/run_session11.sh e   # the final tree (gsum, PDL, window-only launch, merge block 128, 4-warp combine
#                                        # when many rows): all GPU kernel + StaticOscarCache tests, decode rows
#                                        # B=1,8,32 x 8K,32K,128K against BF16 SDPA, per-kernel profile
#   bash benchmarks/run_session11.sh f   # end to end: generate at B=8 / 32K (session 9's command)
#   bash benchmarks/run_session11.sh g   # run f's StaticOscarCache step was slower than session 10's (29.7 vs 28.0 ms):
#                                        # generate B=8 / 32K, oscar-static under this tree's CONFIG, without PDL, and
#                                        # under session 10's choices, one process each
#   bash benchmarks/run_session11.sh h   # the final tree (PDL off by default after run g): all GPU kernel +
#                                        # StaticOscarCache tests, decode rows against BF16 SDPA, per-kernel profile
#   bash benchmarks/run_session11.sh i   # the final tree end to end: generate B=8 / 32K (bf16, oscar-static,
#                                        # bf16-static)
#   bash benchmarks/run_session11.sh j   # after the review (the Gluon kernel's loop state from one helper; same SASS hot
#                                        # loop and registers): the Gluon GPU tests
source benchmarks/device_env.sh
case "$1" in
a)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon" --rootdir "$R" 2>&1 | tee "$OUT/tests_session11a.log" | tail -8
  timeout 330 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon_win_split": 128}' '{"merge_block": 128}' '{"gluon_gsum": 1}' \
      '{"gluon_gsum": 1, "gluon_maxnreg": 176, "gluon_resident": 11}' \
      --out "$OUT/profile_op_h200_session11a.json" 2>&1 | grep -E "^B=|_hist|_split|_combine|graph"
  ;;
esac
case "$1" in
b)
  timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session11b.log" | tail -4
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"pdl": 0}' '{"gluon_gsum": 1}' '{"gluon_win_stages": 1}' '{"gluon_win_split": 0}' \
      --out "$OUT/profile_op_h200_session11b.json" 2>&1 | grep -E "^B=|_hist|_split|_combine|graph"
  ;;
esac
ncu_comb() {
  timeout 150 ncu --clock-control none -k regex:_combine_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section LaunchStats --section MemoryWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" python3 "$R/scripts/profile_split_kernel.py" \
    --batch "$2" --length "$3" --config '{"pdl": 0}' > "$1" 2>&1
  grep -E "Duration|Registers Per|Achieved Occ|Issued Warp|No Eligible|Active Warps Per|long_scoreboard|_wait_|_barrier|_math_pipe|_mio|_short_score|_lg_throttle|Executed Instructions  |Memory Throughput|DRAM Throughput|L2 Hit|Grid Size|Block Size|Waves" \
      "$1" | head -30
}
case "$1" in
c)
  ncu_comb "$OUT/ncu_combine_b1_session11c.txt" 1 131072
  ncu_comb "$OUT/ncu_combine_b32_session11c.txt" 32 32768
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,32x32768 --iters 10 \
      --configs '{"pdl": 0}' '{"pdl": 0, "merge_block": 16}' '{"pdl": 0, "merge_block": 32}' '{"pdl": 0, "merge_block": 128}' \
      --out "$OUT/profile_op_h200_session11c.json" 2>&1 | grep -E "^B=|_combine"
  ;;
esac
case "$1" in
d)
  timeout 400 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"merge_block": 128}' '{"merge_block": 128, "merge_warps": 16}' \
      '{"merge_block": 256, "merge_warps": 16}' '{"merge_warps": 4, "merge_cblock": 32}' \
      '{"merge_block": 128, "merge_warps": 4, "merge_cblock": 32}' '{"merge_block": 32, "merge_warps": 4, "merge_cblock": 32}' \
      '{"merge_block": 128, "merge_warps": 8, "merge_cblock": 32}' \
      --out "$OUT/profile_op_h200_session11d.json" 2>&1 | grep -E "^B=|_combine"
  ;;
esac
case "$1" in
e)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session11e.log" | tail -3
  timeout 250 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session11e.json" 2>&1 | tee "$OUT/bench_kernels_session11e.log" | tail -12
  timeout 100 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' --out "$OUT/profile_op_h200_session11e.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
case "$1" in
f)
  timeout 500 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 \
      --methods bf16 oscar-static bf16-static --out "$OUT/generate_h200_b8_t32768_session11.json" 2>&1 \
      | tee "$OUT/bench_generate_session11.log" | grep -v "it/s" | tail -15
  ;;
esac
case "$1" in
g)
  S10='{"pdl": 0, "gluon_gsum": 0, "merge_block": 64, "gluon_win_split": 0, "gluon_win_stages": 1}'
  i=0
  for c in '{}' '{"pdl": 0}' "$S10"; do
    i=$((i+1))
    timeout 180 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 --methods oscar-static \
        --config "$c" --out "$OUT/generate_h200_b8_t32768_session11g$i.json" 2>&1 | grep '"method"' | cut -c1-200
  done
  ;;
esac
case "$1" in
h)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session11h.log" | tail -3
  timeout 120 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session11h.json" 2>&1 | tee "$OUT/bench_kernels_session11h.log" | tail -11
  timeout 60 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' --out "$OUT/profile_op_h200_session11h.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
case "$1" in
i)
  timeout 400 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 \
      --methods bf16 oscar-static bf16-static --out "$OUT/generate_h200_b8_t32768_session11h.json" 2>&1 \
      | grep '"method"' | cut -c1-160
  ;;
esac
case "$1" in
j)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" -k gluon \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session11j.log" | tail -3
  ;;
esac
