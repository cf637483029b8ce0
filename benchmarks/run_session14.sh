#!/usr/bin/env bash
# Session-14 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session14.sh a   # the rotation launched by the op itself, with the window programs
#                                        # (fused_prologue), the Gluon kernel's early first loads (gluon_early) and
#                                        # programmatic dependent launch rotation -> history (pdl 2): their GPU tests,
#                                        # the per-kernel profile of each against session 13's layout, the benchmark
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      "$R/tests/test_static_cache.py" -k "rotating or early or static" --rootdir "$R" 2>&1 \
      | tee "$OUT/tests_session14a.log" | tail -3
  timeout 150 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{"fused_prologue": 0}' '{}' '{"gluon_early": 1}' '{"gluon_early": 1, "pdl": 2}' \
      '{"gluon_early": 1, "pdl": 2, "merge_block": 256}' \
      --out "$OUT/profile_op_${GPU}_session14a.json" 2>&1 | grep -E "^B=|_kernel"
  timeout 90 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session14a.json" 2>&1 | tee "$OUT/bench_kernels_session14a.log" | tail -11
  ;;
esac
# (appended) run b: session 13's layout (rotation and window launches of their own) against the new default (fused
# prologue, early first loads, one-round combine at B=1) and programmatic dependent launch rotation -> history (pdl 2):
# per-kernel profile; and end to end, the compiled StaticOscarCache step (B=8, 32K prompt) without and with pdl 2
#   bash benchmarks/run_session14.sh b
case "$1" in
b)
  timeout 100 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{"fused_prologue": 0, "gluon_early": 0, "merge_block_few": 128}' '{}' '{"pdl": 2}' \
      --out "$OUT/profile_op_${GPU}_session14b.json" 2>&1 | grep -E "^B=|_kernel"
  timeout 200 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 --methods oscar-static \
      --out "$OUT/generate_${GPU}_b8_t32768_session14b.json" 2>&1 | grep '"method"' | cut -c1-160
  timeout 200 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 --methods oscar-static \
      --config '{"pdl": 2}' --out "$OUT/generate_${GPU}_b8_t32768_session14b_pdl2.json" 2>&1 | grep '"method"' | cut -c1-160
  ;;
esac
# (appended) run c: the final tree: every GPU kernel + StaticOscarCache test, the kernel benchmark
#   bash benchmarks/run_session14.sh c
case "$1" in
c)
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_${GPU}_session14c.log" | tail -3
  timeout 120 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session14c.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session14c.log" | tail -11
  ;;
esac
# (appended) run d: the kernel benchmark of the final tree on the other GPU kind
#   bash benchmarks/run_session14.sh d
case "$1" in
d)
  timeout 120 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session14d.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session14d.log" | tail -11
  ;;
esac
# (appended) runs e and f: the StaticOscarCache GPU tests (cut off by run c's time limit), and end to end the compiled
# StaticOscarCache step (B=8, 32K prompt) of session 13's tree (HEAD before this session's changes, carried as .old14/:
# `git archive 1d160e8 oscar_hf kernels eval scripts`) against this tree, on the same machine. e: the static cache with
# the rotation inside its opaque op (measured slower); f: the static cache back on its session-13 route
#   bash benchmarks/run_session14.sh e|f
static_old_new() {
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/test_static_cache.py" --rootdir "$R" 2>&1 \
      | tee "$OUT/tests_${GPU}_session14$1.log" | tail -3
  OLD=/tmp/oscar_old; rm -rf $OLD; mkdir -p $OLD; cp -r "$R/.old14/oscar_hf" $OLD/oscar_hf
  cp -r "$R/.old14/kernels" $OLD/oscar_hf/kernels; cp -r "$R/.old14/eval" $OLD/oscar_hf/eval
  PYTHONPATH=$OLD timeout 170 python3 "$R/.old14/scripts/bench_generate.py" --contexts 32768 --batches 8 \
      --methods oscar-static --out "$OUT/generate_${GPU}_b8_t32768_session14$1_old.json" 2>&1 | grep '"method"' | cut -c1-200
  timeout 170 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 --methods oscar-static \
      --out "$OUT/generate_${GPU}_b8_t32768_session14$1.json" 2>&1 | grep '"method"' | cut -c1-200
}
case "$1" in
e|f) static_old_new "$1" ;;
esac
