#!/usr/bin/env bash
# Session-19 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session19.sh a   # the int8 key path with one int8 query operand a plane (gluon_k8_lo 0: 8 MMAs
#                                        # a 32-token step fewer, 16 registers fewer -- no spill in the loop down to 144
#                                        # registers, sm_90 SASS 317 instructions a step against 324): its GPU tests
#                                        # (variants "k8-single", "k8-single-144") and its precision against the (hi, lo)
#                                        # pairs and the fp16 path, beside the INT2 cache's own error
#   bash benchmarks/run_session19.sh b   # the op's per-kernel profile: default, gluon_k8_lo 0 under caps of 168 / 152 /
#                                        # 144 / 136 registers (12-15 one-warp programs an SM), and int8 keys everywhere
# Runs a and b ran at commit f4ddcb2, which added gluon_k8_lo; it was removed afterwards (README_kernels, "Session 19").
#   bash benchmarks/run_session19.sh c   # fewer one-warp programs an SM (register caps 184 / 200 / 232: 11 / 10 / 8,
#                                        # no spill at 232) against the default 168 (12), then the benchmark of the tree
#                                        # (one more sample of the run-to-run spread at B=8/128K)
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and k8-single" 2>&1 | tee "$OUT/tests_${GPU}_session19a.log" | tail -2
  timeout 200 python3 "$R/scripts/gluon_q8_precision.py" --out "$OUT/q8_precision_${GPU}_session19a.json" 2>&1 \
      | grep -v Warn
  ;;
b)
  timeout 560 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768,8x8192 --iters 20 \
      --configs '{}' '{"gluon_k8_lo": 0}' '{"gluon_k8_lo": 0, "gluon_maxnreg": 152, "gluon_resident": 13}' \
      '{"gluon_k8_lo": 0, "gluon_maxnreg": 144, "gluon_resident": 14}' \
      '{"gluon_k8_lo": 0, "gluon_maxnreg": 136, "gluon_resident": 15}' '{"gluon_k8_lo": 0, "gluon_k8": 2}' \
      --out "$OUT/profile_op_${GPU}_session19b.json" 2>&1 | grep -E "^B=|_hist"
  ;;
esac
case "$1" in
c)
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768 --iters 20 \
      --configs '{}' '{"gluon_maxnreg": 184, "gluon_resident": 11}' '{"gluon_maxnreg": 200, "gluon_resident": 10}' \
      '{"gluon_maxnreg": 232, "gluon_resident": 8}' \
      --out "$OUT/profile_op_${GPU}_session19c.json" 2>&1 | grep -E "^B=|_hist"
  timeout 280 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session19c.json" 2>&1 | grep -v Warn | tail -12
  ;;
esac
# (appended) run d: run c's 8 programs an SM (232 registers) again, with ptxas uncapped (255) and with 8 / 2 pipeline
# stages on long splits, at five points
#   bash benchmarks/run_session19.sh d
case "$1" in
d)
  timeout 400 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768,8x8192,32x131072 \
      --iters 20 --configs '{}' '{"gluon_maxnreg": 232, "gluon_resident": 8}' '{"gluon_maxnreg": 255, "gluon_resident": 8}' \
      '{"gluon_maxnreg": 232, "gluon_resident": 8, "gluon_stages_long": 8}' \
      '{"gluon_maxnreg": 232, "gluon_resident": 8, "gluon_stages_long": 2}' \
      --out "$OUT/profile_op_${GPU}_session19d.json" 2>&1 | grep -E "^B=|_hist"
  ;;
esac
# (appended) run e: the long splits' residency as the default (gluon_resident_long 8, gluon_maxnreg_long 255): the Gluon
# GPU tests of the default, int8-key and long-split variants ("long": every split long), then the benchmark
#   bash benchmarks/run_session19.sh e
# run f (H100): the same change against the old residency (gluon_resident_long None) per kernel, and the benchmark
#   bash benchmarks/run_session19.sh f
case "$1" in
e)
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and (long or k8 or early-pdl2)" 2>&1 | tee "$OUT/tests_${GPU}_session19e.log" | tail -2
  timeout 250 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session19e.json" 2>&1 | grep -v Warn | tail -10
  ;;
f)
  timeout 250 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768,8x8192,32x131072 \
      --iters 20 --configs '{}' '{"gluon_resident_long": null}' \
      --out "$OUT/profile_op_${GPU}_session19f.json" 2>&1 | grep -E "^B=|_hist"
  timeout 300 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session19f.json" 2>&1 | grep -v Warn | tail -10
  ;;
esac
# (appended) run g (H200): the benchmark of the final tree again, a second sample of the new default
#   bash benchmarks/run_session19.sh g
case "$1" in
g)
  timeout 280 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session19g.json" 2>&1 | grep -v Warn | tail -10
  ;;
esac
