#!/usr/bin/env bash
# Session-28 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session28.sh a   # scripts/probe_copy_queue.py: does an L2-hot poll / load queue behind a
#                                        # program's own early copies, by cp.async (the SM's load path) and by
#                                        # cp.async.bulk (the bulk-copy engine)? (H100)
#   bash benchmarks/run_session28.sh b   # the same on the H200
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a|b)
  timeout 300 python3 "$R/scripts/probe_copy_queue.py" --out "$OUT/probe_copy_queue_${GPU}_session28$1.json" 2>&1 \
      | grep -v -E "Warn|warn"
  ;;
esac
# (appended) runs a (H100, probe_copy_queue_h100_session28a.json) and b (H200, probe_copy_queue_h200_session28b.json):
# copied bytes right in every mode. Entry -> poll and operand load done, p50, at 7680 bytes a program (the history's
# three early steps): no copies 0.54 us; cp.async 2.94 (H100) / 2.30 (H200), the same as the copies' landing;
# cp.async.bulk in 512-byte pieces 2.62 / 2.21, in three pieces 2.50 / 2.05. The bulk engine lets the poll back
# sooner, but the operand load after it then waits for the stream's bytes: at most ~0.45 us of the ~2.2 us B=1/128K
# needs on the H100. Not built (benchmarks/README_kernels.md, session 28).
# Run c (H100): the GPU tests of session 25's run u (the decode op's Gluon variants, the counters, the prologue's
# operands, the op in a CUDA graph, the timestamps) and the write path's, on the tree that closes issue 4 (its kernels
# differ from run u's by two refactors of host code)
#   bash benchmarks/run_session28.sh c
case "$1" in
c)
  timeout 575 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_query_rotation.py" "$R/tests/kernels/test_int2_attention.py" "$R/tests/kernels/test_write_path.py" \
      -k "qflag or pdl5 or q8 or prologue_query_operands or timestamps or in_graph or smem3 or long5 or (rotating and (k8 or long or early-pdl2)) or write" \
      2>&1 | tee "$OUT/tests_${GPU}_session28$1.log" | tail -4
  ;;
esac
# (appended) run c's result (H100, tests_h100_session28c.log): 179 passed in 551 s.
