#!/usr/bin/env bash
# Session-18 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session18.sh a   # the history kernel's access pattern without its arithmetic (the read floor
#                                        # over its grid and its six streams, and over two denser layouts of the same
#                                        # bytes), and the combine with 2 / 4 / 8 programs a row (merge_csplit)
# Runs a, b, c, e measured options that were removed afterwards (benchmarks/README_kernels.md, "Session 18"); each ran
# at the commit that added it: a at 134ba4f (merge_csplit), b at abd5bc3 (gluon_pair), c at efd216d (gluon_qsmem),
# e at 145766c (profile_decode_op's "_rv": "bf16"). Run d ran on the final tree's defaults.
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
# (appended) run b: the Gluon history loop two full steps at a time between barriers (gluon_pair: both steps' logits,
# then both steps' values, so that ptxas interleaves the second step's key MMAs with the first's softmax and values;
# sm_90 SASS: 644 instructions a pair against 2 x 324), its GPU tests (variants "pair": int8 keys, "pair-fp16") and
# the per-kernel profile against the default
#   bash benchmarks/run_session18.sh b
case "$1" in
b)
  timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and pair" 2>&1 | tee "$OUT/tests_${GPU}_session18b.log" | tail -2
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768,8x8192 --iters 20 \
      --configs '{}' '{"gluon_pair": 1}' '{"gluon_pair": 1, "gluon_stages": 4}' \
      --out "$OUT/profile_op_${GPU}_session18b.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run c: the int8 query operands in shared memory (gluon_qsmem: ldmatrix at each step, 32 registers fewer,
# sm_90 SASS 336 instructions a step against 324, no spill in the loop down to 136 registers), so that 13-15 one-warp
# programs fit an SM instead of 12: its GPU tests (variant "qsmem") and the profile at the points where the int8 key
# path runs
#   bash benchmarks/run_session18.sh c
case "$1" in
c)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and qsmem" 2>&1 | tee "$OUT/tests_${GPU}_session18c.log" | tail -2
  timeout 350 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,32x32768,32x131072 --iters 20 \
      --configs '{}' '{"gluon_qsmem": 1}' '{"gluon_qsmem": 1, "gluon_maxnreg": 152, "gluon_resident": 13}' \
      '{"gluon_qsmem": 1, "gluon_maxnreg": 144, "gluon_resident": 14}' \
      '{"gluon_qsmem": 1, "gluon_maxnreg": 136, "gluon_resident": 15}' \
      --out "$OUT/profile_op_${GPU}_session18c.json" 2>&1 | grep -E "^B=|_hist"
  ;;
esac
# (appended) run d: the benchmark of the final tree (the defaults of session 17: runs a-c changed no default) on this
# session's H200, one more sample of the run-to-run spread at B=8/128K
#   bash benchmarks/run_session18.sh d
case "$1" in
d)
  timeout 300 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session18d.json" 2>&1 | grep -v Warn | tail -12
  ;;
esac
# (appended) run e: R_V in bf16 for the combine (half of its 64 KB a row program; the products stay float32), with R_V
# in 64-row chunks (the default), 32-row chunks, or whole (merge_cblock 128: loaded before the partials)
#   bash benchmarks/run_session18.sh e
case "$1" in
e)
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768,8x8192 --iters 20 \
      --configs '{}' '{"_rv": "bf16"}' '{"_rv": "bf16", "merge_cblock": 32}' '{"_rv": "bf16", "merge_cblock": 128}' \
      --out "$OUT/profile_op_${GPU}_session18e.json" 2>&1 | grep -E "^B=|_combine"
  ;;
esac
# (appended) run f: Nsight Compute on the final tree's history kernel at B=8/128K: stall reasons, issue slots and the
# utilization of each pipe (which one binds the ~31 us above the access pattern's floor)
#   bash benchmarks/run_session18.sh f
case "$1" in
f)
  timeout 300 ncu --clock-control none -k regex:_hist_kernel --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section SchedulerStats --section WarpStateStats \
    --section ComputeWorkloadAnalysis --section InstructionStats --section MemoryWorkloadAnalysis \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active" \
    python3 "$R/scripts/profile_split_kernel.py" --batch 8 --length 131072 > "$OUT/ncu_hist_h200_session18f.txt" 2>&1
  grep -E "Duration|Issued Warp|No Eligible|Active Warps Per|_wait_|_math_pipe|long_scoreboard|short_score|_mio|_not_selected|_selected|_dispatch|pipe_.*(tensor|alu|fma|fp16|lsu|xu|uniform|shared).*%|Executed Ipc|Issue Slots|DRAM Throughput|L2 Cache Throughput" \
      "$OUT/ncu_hist_h200_session18f.txt" | head -60
  ;;
esac
# (appended) run g: after the review's refactor (one helper, decode_triton.gluon_split_cfg, gives the Gluon path's
# wave-model inputs to the dispatch and to the access pattern's floor): the Gluon decode-op GPU tests of the default
# variants and the pattern floor at B=8 (the same 49 splits as run a)
#   bash benchmarks/run_session18.sh g
case "$1" in
g)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and (decode_op or history_partial) and (k8 or hoist)" 2>&1 | tee "$OUT/tests_${GPU}_session18g.log" | tail -2
  timeout 150 python3 "$R/scripts/bench_read_floor.py" --batches 8 --length 131072 --pattern \
      --out "$OUT/read_floor_${GPU}_session18g.json" 2>&1 | grep -E "cache6|read_floor_us" | cut -c1-160
  ;;
esac
