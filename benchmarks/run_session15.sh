#!/usr/bin/env bash
# Session-15 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session15.sh a   # the Gluon kernel's key logits on int8 tensor cores (gluon_k8): its GPU
#                                        # tests, the per-kernel profile against the fp16 key path, and the floor of
#                                        # reading the history bytes in one launch (scripts/bench_read_floor.py)
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon and (k8 or early-pdl2)" --rootdir "$R" 2>&1 | tee "$OUT/tests_${GPU}_session15a.log" | tail -3
  timeout 150 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon_k8": 1}' --out "$OUT/profile_op_${GPU}_session15a.json" 2>&1 | grep -E "^B=|_kernel"
  timeout 120 python3 "$R/scripts/bench_read_floor.py" --batches 1,8 --length 131072 \
      --out "$OUT/read_floor_${GPU}_session15a.json" 2>&1 | tail -3
  ;;
esac
# (appended) run b: the int8 key path with its setup's reductions over k first (~200 shuffles -> 20): its GPU tests,
# the per-kernel profile against the fp16 key path, and the kernel benchmark with it
#   bash benchmarks/run_session15.sh b
case "$1" in
b)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon and k8" --rootdir "$R" 2>&1 | tee "$OUT/tests_${GPU}_session15b.log" | tail -3
  timeout 150 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"gluon_k8": 1}' --out "$OUT/profile_op_${GPU}_session15b.json" 2>&1 | grep -E "^B=|_kernel"
  timeout 120 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --config '{"gluon_k8": 1}' --out "$OUT/kernels_${GPU}_session15b.json" 2>&1 \
      | tee "$OUT/bench_kernels_${GPU}_session15b.log" | tail -11
  ;;
esac
# (appended) run c: every GPU kernel test of the tree with the int8 key path on by default where a split holds at
# least gluon_k8_min_split tokens (gluon_k8 1)
#   bash benchmarks/run_session15.sh c
case "$1" in
c)
  timeout 550 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" --rootdir "$R" 2>&1 \
      | tee "$OUT/tests_${GPU}_session15c.log" | tail -3
  ;;
esac
# (appended) run d: the GPU tests run c's time limit cut off (the last 4 decode-op tests of the k8-regs variant, query
# rotation, write path), the StaticOscarCache GPU tests, and the kernel benchmark of the final tree
#   bash benchmarks/run_session15.sh d
case "$1" in
d)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" --rootdir "$R" \
      -k "k8-regs-1-130752 or k8-regs-8-32448 or rotate_query or test_write_path" 2>&1 \
      | tee "$OUT/tests_${GPU}_session15d.log" | tail -2
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/test_static_cache.py" --rootdir "$R" 2>&1 \
      | tee -a "$OUT/tests_${GPU}_session15d.log" | tail -2
  timeout 150 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session15d.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session15d.log" | tail -11
  ;;
esac
# (appended) run e (nvidia-h100-x1): the kernel benchmark of the final tree and the one-launch read floor on the H100
#   bash benchmarks/run_session15.sh e
case "$1" in
e)
  timeout 150 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session15e.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session15e.log" | tail -11
  timeout 100 python3 "$R/scripts/bench_read_floor.py" --batches 1,8 --length 131072 \
      --out "$OUT/read_floor_${GPU}_session15e.json" 2>&1 | grep "^{"
  ;;
esac
