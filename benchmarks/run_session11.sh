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
