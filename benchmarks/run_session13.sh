#!/usr/bin/env bash
# Session-13 device runs (device nvidia-h200: torch 2.11, triton 3.6), from the repository root, one `run` call each;
# results were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session12.sh c   # (re-run this session: session 12's run c was cut off) the skewed 4-stage
#                                        # loop against 2 and 4 stages and register loads
#   bash benchmarks/run_session13.sh a   # the final tree: every GPU kernel + StaticOscarCache test, the kernel
#                                        # benchmark, the per-kernel profile (default, with PDL, the 4-warp combine)
#   bash benchmarks/run_session13.sh b   # the 4-warp combine from one row per SM (B=8): the GPU tests of the decode op and
#                                        # the static cache, the kernel benchmark and per-kernel profile again
#   bash benchmarks/run_session13.sh c   # end to end: generate on a Qwen3-8B-shaped random model, B=8, 32K prompt (the
#                                        # static cache also with programmatic dependent launch)
source benchmarks/device_env.sh
case "$1" in
a)
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session13a.log" | tail -3
  timeout 150 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session13a.json" 2>&1 | tee "$OUT/bench_kernels_session13a.log" | tail -11
  timeout 70 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"pdl": 1}' '{"merge_warps": 4, "merge_cblock": 32}' \
      --out "$OUT/profile_op_h200_session13a.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
b)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      "$R/tests/test_static_cache.py" -k "not gluon_history_partial and not reference_guard" --rootdir "$R" 2>&1 | tee "$OUT/tests_session13b.log" | tail -3
  timeout 90 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session13b.json" 2>&1 | tee "$OUT/bench_kernels_session13b.log" | tail -11
  timeout 30 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' --out "$OUT/profile_op_h200_session13b.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
c)
  timeout 250 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 \
      --methods bf16 oscar-static bf16-static --out "$OUT/generate_h200_b8_t32768_session13.json" 2>&1 \
      | grep '"method"' | cut -c1-160
  timeout 120 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 --methods oscar-static \
      --config '{"pdl": 1}' --out "$OUT/generate_h200_b8_t32768_session13_pdl.json" 2>&1 | grep '"method"' | cut -c1-160
  ;;
esac
# (appended) run d: fewer, longer history splits where the batch is small (CONFIG["min_split"] binds only there) and a
# one-round combine at B=1: per-kernel profile
#   bash benchmarks/run_session13.sh d
case "$1" in
d)
  timeout 100 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072 --iters 10 \
      --configs '{}' '{"min_split": 512}' '{"min_split": 1024}' '{"min_split": 2048}' '{"merge_block": 256}' \
      --out "$OUT/profile_op_h200_session13d.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run e: shorter window programs at B=8 (64 / 32 tokens instead of 128): per-kernel profile
#   bash benchmarks/run_session13.sh e
case "$1" in
e)
  timeout 100 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,8x8192,32x32768,1x131072 --iters 10 \
      --configs '{}' '{"win_split": 64}' '{"win_split": 32}' '{"win_split": 64, "gluon_win_split": 64}' \
      --out "$OUT/profile_op_h200_session13e.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run f: 32-token window programs up to 8 per SM (B=8): the GPU tests of the decode op and the static cache,
# the kernel benchmark
#   bash benchmarks/run_session13.sh f
case "$1" in
f)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      "$R/tests/test_static_cache.py" -k "not gluon_history_partial and not reference_guard" --rootdir "$R" 2>&1 | tee "$OUT/tests_session13f.log" | tail -3
  timeout 60 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_session13f.json" 2>&1 | tee "$OUT/bench_kernels_session13f.log" | tail -11
  ;;
esac
