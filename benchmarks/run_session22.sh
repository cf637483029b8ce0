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
