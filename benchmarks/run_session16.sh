#!/usr/bin/env bash
# Session-16 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session16.sh a   # programmatic dependent launch mode 3 (the window programs a launch of their
#                                        # own in the history kernel's tail, the combine under PDL): its GPU tests and
#                                        # the per-kernel profile against the default (2) and mode 1
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon and pdl3" --rootdir "$R" 2>&1 | tee "$OUT/tests_${GPU}_session16a.log" | tail -3
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"pdl": 3}' '{"pdl": 3, "merge_cblock": 128, "merge_warps": 8}' \
      '{"pdl": 1, "fused_prologue": 0}' --out "$OUT/profile_op_${GPU}_session16a.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run b: pdl 4 (pdl 2, and the combine launched in the history kernel's tail): its GPU tests; the profile
# of it, of one wave of history programs (max_waves 1: half the partials at B=8/128K) and of the combine with R_V
# loaded before its wait
#   bash benchmarks/run_session16.sh b
case "$1" in
b)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon and pdl4" --rootdir "$R" 2>&1 | tee "$OUT/tests_${GPU}_session16b.log" | tail -3
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"pdl": 4}' '{"pdl": 4, "merge_cblock": 128, "merge_warps": 8}' '{"max_waves": 1}' \
      '{"pdl": 4, "max_waves": 1}' --out "$OUT/profile_op_${GPU}_session16b.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run c: the history kernel's memory-level parallelism with the int8 key path: shared-memory pipeline
# stages (gluon_stages) and an L2 prefetch past the pipeline's copies (gluon_smem_l2pf)
#   bash benchmarks/run_session16.sh c
case "$1" in
c)
  timeout 400 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768 --iters 10 \
      --configs '{}' '{"gluon_stages": 4}' '{"gluon_smem_l2pf": 1}' '{"gluon_smem_l2pf": 2}' \
      '{"gluon_stages": 4, "gluon_smem_l2pf": 1}' '{"gluon_smem_l2pf": 4}' \
      --out "$OUT/profile_op_${GPU}_session16c.json" 2>&1 | grep -E "^B=|_hist"
  ;;
esac
# (appended) run d: the decode op's combine with one program per (row, KV head) (merge_heads 2, _combine_head_kernel):
# its GPU tests (with 4 pipeline stages in the history kernel), the profile of it with variants and of 4 stages
#   bash benchmarks/run_session16.sh d
case "$1" in
d)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon and heads" --rootdir "$R" 2>&1 | tee "$OUT/tests_${GPU}_session16d.log" | tail -3
  timeout 400 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"merge_heads": 2}' '{"merge_heads": 2, "merge_head_step": 16}' \
      '{"merge_heads": 2, "merge_head_warps": 4}' '{"gluon_stages": 4}' '{"gluon_stages": 4, "merge_heads": 2}' \
      --out "$OUT/profile_op_${GPU}_session16d.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run e: with 4 pipeline stages in the history kernel (run c): 8 stages (11 or 12 programs an SM), and the
# prologue's window programs of 64 / 128 tokens and without software pipelining. (Run d's per-head combine,
# _combine_head_kernel, was 2-4x slower than the per-row one where a row has many splits: removed.)
#   bash benchmarks/run_session16.sh e
case "$1" in
e)
  timeout 400 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768 --iters 10 \
      --configs '{"gluon_stages": 4}' '{"gluon_stages": 4, "gluon_win_split": 64}' \
      '{"gluon_stages": 4, "gluon_win_split": 128}' '{"gluon_stages": 4, "gluon_win_stages": 1}' \
      '{"gluon_stages": 8}' '{"gluon_stages": 8, "gluon_resident": 11}' \
      --out "$OUT/profile_op_${GPU}_session16e.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) After run e: pdl 3 / 4 (runs a, b: no gain, B=8/128K 220.0 / 221.9 vs 221.8 / 221.5 us) and
# gluon_smem_l2pf (run c: slower) removed again. Run f (nvidia-h100-x1): the history kernel's 4 pipeline stages on the
# H100 (profile against 2), and the kernel benchmark with them
#   bash benchmarks/run_session16.sh f
case "$1" in
f)
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{"gluon_stages": 2}' '{"gluon_stages": 4}' --out "$OUT/profile_op_${GPU}_session16f.json" 2>&1 \
      | grep -E "^B=|_hist"
  timeout 200 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --config '{"gluon_stages": 4}' --out "$OUT/kernels_${GPU}_session16f.json" 2>&1 \
      | tee "$OUT/bench_kernels_${GPU}_session16f.log" | tail -11
  ;;
esac
# (appended) run g: the final tree (4 pipeline stages where a split holds >= gluon_long_split tokens): the GPU tests of
# the Gluon variants that take them (the defaults' stages), the StaticOscarCache GPU tests, the kernel benchmark
#   bash benchmarks/run_session16.sh g
case "$1" in
g)
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon and (k8 or smem4 or early-pdl2)" --rootdir "$R" 2>&1 | tee "$OUT/tests_${GPU}_session16g.log" | tail -2
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/test_static_cache.py" --rootdir "$R" 2>&1 \
      | tee -a "$OUT/tests_${GPU}_session16g.log" | tail -2
  timeout 150 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session16g.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session16g.log" | tail -11
  ;;
esac
# (appended) run h (nvidia-h100-x1): the kernel benchmark of the final tree on the H100 (run f's had 4 stages for every
# split)
#   bash benchmarks/run_session16.sh h
case "$1" in
h)
  timeout 150 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session16h.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session16h.log" | tail -11
  ;;
esac
# (appended) run i: the combine's loads hoisted (merge_hoist: window partials and R_V's first chunk with the history
# partials, each next R_V chunk ahead of its use): its GPU tests, the profile with it and variants
#   bash benchmarks/run_session16.sh i
case "$1" in
i)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" \
      -k "gluon and hoist" --rootdir "$R" 2>&1 | tee "$OUT/tests_${GPU}_session16i.log" | tail -2
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
      --configs '{}' '{"merge_hoist": 1}' '{"merge_hoist": 1, "merge_warps": 8}' \
      '{"merge_hoist": 1, "merge_cblock": 64}' '{"merge_hoist": 1, "merge_cblock": 32}' \
      --out "$OUT/profile_op_${GPU}_session16i.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run j: the final tree (combine loads hoisted, R_V in 64-row chunks, by default): the GPU decode-op tests
# (Triton path and the Gluon variants k8, k8-regs, hoist, pdl-less ones), the StaticOscarCache GPU test, the kernel
# benchmark
#   bash benchmarks/run_session16.sh j
case "$1" in
j)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "(decode_op or decode_attention) and not (negmma or gsum or smem4 or early or fp16)" 2>&1 \
      | tee "$OUT/tests_${GPU}_session16j.log" | tail -2
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/test_static_cache.py" --rootdir "$R" 2>&1 \
      | tee -a "$OUT/tests_${GPU}_session16j.log" | tail -2
  timeout 150 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session16j.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session16j.log" | tail -11
  ;;
esac
# (appended) run k (nvidia-h100-x1): the kernel benchmark of the final tree on the H100
#   bash benchmarks/run_session16.sh k
case "$1" in
k)
  timeout 150 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session16k.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session16k.log" | tail -11
  ;;
esac
# (appended) run l: run j's kernel benchmark again at 128K (B=8 was 0.9 us over 4.5x of SDPA; the run-to-run spread of
# the graph times is about that much), twice
#   bash benchmarks/run_session16.sh l
case "$1" in
l)
  for rep in 1 2; do
    timeout 120 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 131072 \
        --out "$OUT/kernels_${GPU}_session16l${rep}.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session16l${rep}.log" \
        | tail -4
  done
  ;;
esac
# (appended) run m: B=32/128K was slower in runs j, l (4.63-4.74x vs 4.96x in run g): the profile with and without the
# hoisted combine there and at B=8/128K
#   bash benchmarks/run_session16.sh m
case "$1" in
m)
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 32x131072,8x131072,32x32768 --iters 10 \
      --configs '{}' '{"merge_hoist": 0}' '{"merge_cblock": 32}' --out "$OUT/profile_op_${GPU}_session16m.json" 2>&1 \
      | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run n: the prologue's window programs of 64 tokens (5 a row and head at B=8 instead of 10 of 32), with and
# without their software pipeline, against the default, 20 iterations
#   bash benchmarks/run_session16.sh n
case "$1" in
n)
  timeout 250 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,8x8192,32x32768 --iters 20 \
      --configs '{}' '{"gluon_win_split": 64}' '{"gluon_win_split": 64, "gluon_win_stages": 1}' \
      --out "$OUT/profile_op_${GPU}_session16n.json" 2>&1 | grep -E "^B=|_prologue"
  ;;
esac
# (appended) run o: the final tree (window programs of 64 tokens on the Gluon path): the Gluon decode-op GPU tests of the
# default-pipeline variants, the kernel benchmark
#   bash benchmarks/run_session16.sh o
case "$1" in
o)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and decode_op and (k8 or early-pdl2 or hoist)" 2>&1 | tee "$OUT/tests_${GPU}_session16o.log" | tail -2
  timeout 150 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session16o.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session16o.log" | tail -11
  ;;
esac
# (appended) run p: after the review's refactor of the combine (one helper for the history/window merge weights of both
# FINAL branches): the decode-op GPU tests of the Gluon variants k8 and hoist, and of the Triton path
#   bash benchmarks/run_session16.sh p
case "$1" in
p)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "(gluon and decode_op and (k8 or hoist)) or decode_attention_real_shapes" 2>&1 \
      | tee "$OUT/tests_${GPU}_session16p.log" | tail -2
  ;;
esac
