#!/usr/bin/env bash
# Session-25 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session25.sh a   # (H100) the combine's wait for the history on counters the history programs
#                                        # raise at their end (CONFIG["gluon_cflag"]) instead of the PDL wait for the
#                                        # history grid's completion: GPU tests, the B=1/128K timeline (now with the
#                                        # combine's programs) and the op's graph time, paired
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a|b)
  timeout 220 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "qflag_counters or timestamps or (in_graph and (cflag or qflag)) or (rotating and cflag)" 2>&1 \
      | tee "$OUT/tests_${GPU}_session25$1.log" | tail -3
  timeout 120 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_cflag": 1}' \
      --out "$OUT/timeline_hist_${GPU}_session25$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_cflag": 1}' '{}' '{"gluon_cflag": 1}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B=|_hist|_prol|_comb"
  ;;
esac
# (appended) run a's result: gluon_cflag is slower (B=1/128K 44.2-44.7 against 42.7-43.7 us): the combine's programs
# already enter ~1.3 us after the last history program's trigger (the PDL launch's latency) and find the history grid
# complete (their PDL wait ends at once), while the counter costs each history program ~0.5 us at its end (the
# release's membar waits for its partials' stores) and the poll ~0.5 us more. Code reverted; the combine's timestamps
# kept. Run c (H100): more pipeline stages on the long-split path, so that more of the history's copies are issued
# before the wait for the query (~6 us at B=1/128K, in which 4 stages load ~8 of the 84 MB), and 8 combine programs
# a row; GPU test of the timestamps
#   bash benchmarks/run_session25.sh c
case "$1" in
c|d)
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "timestamps" 2>&1 | tee "$OUT/tests_${GPU}_session25$1.log" | tail -2
  timeout 160 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 6}' '{"gluon_stages_long": 8}' '{"merge_out_parts": 8}' \
      --out "$OUT/timeline_hist_${GPU}_session25$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,32x32768 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 6}' '{"gluon_stages_long": 8}' '{"merge_out_parts": 8}' '{}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run c's result: 6 pipeline stages on the long-split path (CONFIG["gluon_stages_long"], 4 until now) took
# B=1/128K from 42.4-43.4 to 41.1 us, B=8/128K 249.2-249.6 -> 234.6, B=32/32K 271.6-271.8 -> 261.3 (H100): the loop
# itself runs faster with more copies in flight (ref_step -> loop_end p50 24.6 -> 21.0 us) although the rotation ends
# later (its loads queue behind the larger early copies: wait p50 5.5 -> 7.9 us); 8 stages: 45.6 / 255.8 / 278.9;
# 8 combine programs a row: 44.0-44.8. Run e (H100): 5, 6, 7 stages, 6 with the L2 prefetch off or 2 steps ahead,
# over the benchmark's points
#   bash benchmarks/run_session25.sh e
case "$1" in
e|f)
  timeout 420 python3 "$R/scripts/profile_decode_op.py" \
      --points 1x8192,1x32768,1x131072,8x8192,8x32768,8x131072,32x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 5}' '{"gluon_stages_long": 6}' '{"gluon_stages_long": 7}' \
      '{"gluon_stages_long": 6, "gluon_l2pf": 0}' '{"gluon_stages_long": 6, "gluon_l2pf": 2}' '{}' \
      '{"gluon_stages_long": 6}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run e's result (H100, graph us, defaults -> 5 stages): B=1/128K 43.1-43.9 -> 39.4, B=8/32K 83.0-83.2 ->
# 72.8, B=8/128K 250.8 -> 203.1, B=32/8K 103.4-103.7 -> 92.6, B=32/32K 270.4-270.9 -> 225.3; 7 stages about as fast
# (40.7 / 74.3 / 202.8 / 93.0 / 237.4), 6 well behind (40.8-41.0 / 76.6 / 234.0 / 99.6 / 260.0), the L2 prefetch
# indifferent; short splits (B=1 at 8K and 32K, 2 stages) unchanged. Run g (H200): the same sweep, and 3 stages on
# the short-split path (CONFIG["gluon_stages"])
#   bash benchmarks/run_session25.sh g
case "$1" in
g|h)
  timeout 420 python3 "$R/scripts/profile_decode_op.py" \
      --points 1x8192,1x32768,1x131072,8x8192,8x32768,8x131072,32x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 5}' '{"gluon_stages_long": 6}' '{"gluon_stages_long": 7}' \
      '{"gluon_stages_long": 5, "gluon_stages": 3}' '{"gluon_stages_long": 3}' '{}' '{"gluon_stages_long": 5}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) runs c, e: INVALID for 5, 6 and 7 stages -- the loop took the stage as it & (STAGES - 1), right only for a
# power of two (5 stages read stages 0 and 4 only: wrong data). The ring now carries its stage (any length, 325
# instead of 322 SASS instructions a step at 5 stages). Run i (H100): the GPU tests of 3- and 5-stage rings, then the
# sweep again (4, 5, 6, 7 stages; 8 was measured right: slower than 4)
#   bash benchmarks/run_session25.sh i
case "$1" in
i|j)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "smem3 or long5" 2>&1 | tee "$OUT/tests_${GPU}_session25$1.log" | tail -3
  timeout 300 python3 "$R/scripts/profile_decode_op.py" \
      --points 1x131072,8x32768,8x131072,32x32768 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 5}' '{"gluon_stages_long": 6}' '{"gluon_stages_long": 7}' \
      '{"gluon_stages_long": 3}' '{}' '{"gluon_stages_long": 5}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run i's result: with the ring right, more stages are no faster (H100 graph us, 4 -> 5 / 6 / 7 stages:
# B=1/128K 42.7-43.9 -> 44.0-44.3 / 44.4 / 45.4, B=8/128K 249.2-249.6 -> 250.5 / 251.2 / 253.2); 3 stages even with 4.
# 50 GPU tests of the 3- and 5-stage rings passed. Run k (H100): half the programs per SM on the long-split path
# (CONFIG["gluon_resident_long"] 4: one warp a scheduler, 64 splits a row at B=1/128K, so half the partials to merge)
# with deeper rings (the smem of 4 programs, not 8), and 6 per SM
#   bash benchmarks/run_session25.sh k
case "$1" in
k|l)
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_resident_long": 4, "gluon_stages_long": 8}' \
      --out "$OUT/timeline_hist_${GPU}_session25$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 330 python3 "$R/scripts/profile_decode_op.py" \
      --points 1x131072,8x32768,8x131072,32x32768 --iters 10 \
      --configs '{}' '{"gluon_resident_long": 4}' '{"gluon_resident_long": 4, "gluon_stages_long": 8}' \
      '{"gluon_resident_long": 4, "gluon_stages_long": 6}' '{"gluon_resident_long": 6, "gluon_stages_long": 6}' \
      '{"gluon_resident_long": 6}' '{}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run k's result: a lower residency setting does not make fewer programs share an SM -- the hardware still
# packs 8 (512 programs on 66 SMs): B=1/128K 58-60 us. Run m (H100): the history programs wait for the query operands
# themselves (CONFIG["gluon_qsent"]: persistent buffers of sentinels, loaded until none is left) instead of a counter
# the rotation programs raise after a release (~1 us of membar) -- the key offset now travels in the operands' fields
# too; GPU tests, the B=1/128K timeline and the op's graph time, paired
#   bash benchmarks/run_session25.sh m
case "$1" in
m|n)
  timeout 280 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_int2_attention.py" "$R/tests/kernels/test_query_rotation.py" \
      -k "qflag_counters or qsent or timestamps or q8 or prologue_query_operands" 2>&1 \
      | tee "$OUT/tests_${GPU}_session25$1.log" | tail -3
  timeout 120 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_qsent": 1}' \
      --out "$OUT/timeline_hist_${GPU}_session25$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_qsent": 1}' '{}' '{"gluon_qsent": 1}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run m: wrong results (the operands' names shadowed the split's bounds: the loop did not run); fixed, run n
# (H100, `bash benchmarks/run_session25.sh n`): 36 GPU tests passed, but gluon_qsent is slower -- B=1/128K 46.0-46.7
# against 42.6-43.5 us: the rotation programs exit sooner (p50 4.2 against 4.9 us), but the history's poll of the
# four field words ends later (p50 6.5 against 5.5: the polls of 1024 programs queue behind their early copies) and
# its first loads often find a plane's tiles not yet all written, so the loads repeat (waited -> ref_step p50 3.3
# against 1.0 us); B=8 and B=32 +0.4%. Code reverted (the counter after a release stays).
# Run o (H100): two waves of shorter splits at B=1 (CONFIG["programs_per_sm"] 16: 256 splits a row and head instead of
# 128), so that the hardware hands the second wave's programs to the SMs that finish first (a balance of the ends'
# spread at no cost inside the loop), with the combine's 256-split tile in 4 or 8 warps
#   bash benchmarks/run_session25.sh o
case "$1" in
o|p)
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"programs_per_sm": 16}' \
      --out "$OUT/timeline_hist_${GPU}_session25$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 250 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768 --iters 10 \
      --configs '{}' '{"programs_per_sm": 16}' '{"programs_per_sm": 16, "merge_warps_few": 8}' \
      '{"programs_per_sm": 12}' '{"programs_per_sm": 24}' '{}' '{"programs_per_sm": 16}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run o's result: two waves are slower -- B=1/128K 47.0-47.7 against 42.4-43.6 us, B=1/32K 44.6-45.4
# against 35.8-36.1 (the second wave enters at ~20 us and ends by 36.4, later than one wave's 34.7, and the combine of
# 256 splits a row takes 4.9 instead of 2.4 us). Run q (H100): the combine's shape for few rows at B=1 (programs a row,
# warps, output channels a step), and the history's L2 prefetch off / 2 steps ahead
#   bash benchmarks/run_session25.sh q
case "$1" in
q|r)
  timeout 250 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768 --iters 10 \
      --configs '{}' '{"merge_out_parts": 2}' '{"merge_warps_few": 8}' '{"merge_out_parts": 2, "merge_warps_few": 8}' \
      '{"merge_cblock": 16}' '{"gluon_l2pf": 0}' '{"gluon_l2pf": 2}' '{}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B=|_comb"
  ;;
esac
# (appended) run q's result: the defaults are the best of these (B=1/128K combine 3.8 us; 2 programs a row 4.1, 8 warps
# 5.5, 16-channel steps 4.8), the L2 prefetch indifferent. Run s (H100): fewer warps a combine program (the trend of
# 8 -> 4 warps), with a row's splits in one or two rounds
#   bash benchmarks/run_session25.sh s
case "$1" in
s|t)
  timeout 250 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768 --iters 10 \
      --configs '{}' '{"merge_warps_few": 2}' '{"merge_warps_few": 2, "merge_block_few": 64}' \
      '{"merge_warps_few": 2, "merge_out_parts": 8}' '{"merge_warps_few": 1, "merge_block_few": 32}' '{}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B=|_comb"
  ;;
esac
# (appended) run s's result: fewer warps are slower at 128K (2 warps: 44.1-47.2 us, 1 warp 46.4; 0.3-0.5 us faster at
# 32K). Nothing of runs a-s is kept but the ring fix and the combine's timestamps. Run u (H100): the GPU tests of the
# decode op's Gluon path on the final tree
#   bash benchmarks/run_session25.sh u
case "$1" in
u)
  timeout 560 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_query_rotation.py" "$R/tests/kernels/test_int2_attention.py" \
      -k "qflag or pdl5 or q8 or prologue_query_operands or timestamps or in_graph or smem3 or long5 or (rotating and (k8 or long or early-pdl2))" \
      2>&1 | tee "$OUT/tests_${GPU}_session25$1.log" | tail -4
  ;;
esac
# Run v (H100): the short-split path at B=1 on the H100 (fp16 keys, 2 stages, 12 programs an SM under 168 registers;
# session 20 chose the long-split path everywhere from H200 numbers), and the long path at 12 programs an SM
#   bash benchmarks/run_session25.sh v
case "$1" in
v)
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072 --iters 10 \
      --configs '{}' '{"gluon_long_split": 1073741824}' '{"gluon_resident_long": 12, "gluon_maxnreg_long": 168}' '{}' \
      --out "$OUT/profile_op_${GPU}_session25$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run v's result: the defaults stay -- the short-split path 54.3 us at B=1/128K (against 43.0-43.6), the
# long path at 12 programs an SM 53.2; B=8/128K 270.0 / 267.2 against 253.6-254.0; B=1/32K even.
