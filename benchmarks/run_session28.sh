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
