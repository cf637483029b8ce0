#!/usr/bin/env bash
# Session-22 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session22.sh a   # (H100, then H200 as run b) the history kernel's programs inside the B=1/128K
#                                        # op: per-program timestamps (scripts/timeline_hist_programs.py) under the
#                                        # defaults, without PDL, with fp16 keys, without early loads; B=8/128K; and
#                                        # the kernel-level timeline of the same op
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a|b)
  timeout 300 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"pdl": 0}' '{"gluon_k8": 0}' '{"gluon_early": 0}' '{"gluon_resident_long": 6}' \
      --out "$OUT/timeline_hist_${GPU}_session22$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 120 python3 "$R/scripts/timeline_hist_programs.py" --points 8x131072 --iters 5 --configs '{}' \
      --out "$OUT/timeline_hist_b8_${GPU}_session22$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 120 python3 "$R/scripts/profile_decode_op.py" --points 1x131072 --iters 20 --timeline --configs '{}' \
      --out "$OUT/profile_op_${GPU}_session22$1.json" 2>&1 | grep -E "^B=|graph:"
  ;;
esac
# (appended) run c (H100), d (H200): run a found the B=1/128K history programs waiting 5.1 us for the rotation (their
# early copies, 3 steps, done long before) and then 3.3 us on the query operands before the loop, which streams at the
# copy bandwidth (24.6 us for 31 steps): 8 pipeline stages on the long-split path (7 steps of copies in flight before
# the wait), with int8 / fp16 keys; graph time at B=1 and B=8
#   bash benchmarks/run_session22.sh c
case "$1" in
c|d)
  timeout 200 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 8}' '{"gluon_stages_long": 8, "gluon_k8": 0}' \
      --out "$OUT/timeline_hist_${GPU}_session22$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 8}' '{"gluon_stages_long": 8, "gluon_k8": 0}' \
      --out "$OUT/profile_op_${GPU}_session22$1.json" 2>&1 | grep -E "^B=|_hist"
  ;;
esac
# (appended) run e (H100): 8 stages did not help (run c: the rotation ends later under the deeper early copies, the
# setup after it takes longer); the prologue's programs stamped too (rotation / window: entry, exit)
#   bash benchmarks/run_session22.sh e
case "$1" in
e)
  timeout 200 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"pdl": 0}' '{"gluon_early": 0}' \
      --out "$OUT/timeline_hist_${GPU}_session22$1.json" 2>&1 | grep -v -E "Warn|warn"
  ;;
esac
# (appended) run f (H100): run e showed the rotation programs ending at p50 3.3 but max 6.1 us under the history's
# early loads, and the history's query setup taking 3.2 us after its wait, with the query sums' loads issued after
# the operands' arithmetic (a second round trip, sm_90 SASS). Changes: mu_K loaded with q and R_K by every rotation
# program (_rotate_block), the query sums from the loaded planes (_q_sums), the offset's load first. GPU tests of the
# Gluon path (its variants, the rotating op, the timestamps), then the timeline and the op's graph time
#   bash benchmarks/run_session22.sh f
case "$1" in
f)
  timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" -x \
      "$R/tests/kernels/test_int2_attention.py" "$R/tests/kernels/test_query_rotation.py" \
      -k "timestamps or rotation or (gluon and (early-pdl2 or fp16-keys or k8 or long or short or regs))" \
      2>&1 | tee "$OUT/tests_${GPU}_session22$1.log" | tail -3
  timeout 120 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 --configs '{}' \
      --out "$OUT/timeline_hist_${GPU}_session22$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' --out "$OUT/profile_op_${GPU}_session22$1.json" 2>&1 | grep -E "^B=|_hist|_prol"
  ;;
esac
# (appended) run g (H100): run f's tests passed up to the command's time limit (128, none failed); the rest of them
# (the rotating op, the rotation kernel, the timestamps), then the benchmark of the tree
# run h (H200): the same, the B=1/128K timeline
#   bash benchmarks/run_session22.sh g
#   bash benchmarks/run_session22.sh h
case "$1" in
g|h)
  # (run h: only the new test, the rotating op in a graph and the rotation kernel, with their names)
  if [ "$1" = h ]; then
    timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu --rootdir "$R" \
        "$R/tests/kernels/test_int2_attention.py" "$R/tests/kernels/test_query_rotation.py" \
        -k "timestamps or (rotating_in_graph and early-pdl2) or rotate_query_kernel_gpu" 2>&1 \
        | grep -E "PASS|FAIL|passed|failed" | tee "$OUT/tests_${GPU}_session22$1.log" | tail -8
  else
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
        "$R/tests/kernels/test_int2_attention.py" "$R/tests/kernels/test_query_rotation.py" \
        -k "timestamps or rotating or rotation or (gluon and early-pdl2)" \
        2>&1 | tee "$OUT/tests_${GPU}_session22$1.log" | tail -3
  fi
  timeout 330 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session22$1.json" 2>&1 | grep -v -E "Warn|return F" | tail -12
  if [ "$1" = h ]; then
    timeout 60 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 --configs '{}' \
        --out "$OUT/timeline_hist_${GPU}_session22$1.json" 2>&1 | grep -v -E "Warn|warn"
  fi
  ;;
esac
# (appended) run i (H200), j (H100): the timestamps also record each program's warp slot (%warpid; slot % 4 is its
# scheduler): do the programs that end last share their scheduler with more programs? (H200 run h: programs of the same
# SM ended up to ~5 us apart); the timestamp test again
#   bash benchmarks/run_session22.sh i
case "$1" in
i|j)
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "timestamps" 2>&1 | tee "$OUT/tests_${GPU}_session22$1.log" | tail -2
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072,8x131072 --iters 10 --configs '{}' \
      --out "$OUT/timeline_hist_${GPU}_session22$1.json" 2>&1 | grep -v -E "Warn|warn"
  ;;
esac
# (appended) run k (H100), after the review: the timestamp buffer's shape checked on the host before the launches
# (_check_times_buf); the timestamps test and the rotating op (in a graph) again
#   bash benchmarks/run_session22.sh k
case "$1" in
k)
  timeout 200 python3 -m pytest -v -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "timestamps or (rotating and early-pdl2)" 2>&1 | grep -E "PASS|FAIL|passed|failed" \
      | tee "$OUT/tests_${GPU}_session22$1.log" | tail -12
  ;;
esac
