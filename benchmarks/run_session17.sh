#!/usr/bin/env bash
# Session-17 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session17.sh a   # the window attended by the combine kernel itself (combine_window: the
#                                        # history kernel waits for the query rotation alone), with and without the
#                                        # combine under PDL (pdl 4): its GPU tests and the per-kernel profile
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and decode_op and cwin" 2>&1 | tee "$OUT/tests_${GPU}_session17a.log" | tail -2
  timeout 350 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,8x8192,32x32768 --iters 20 \
      --configs '{}' '{"combine_window": 1, "combine_window_max": 512}' \
      '{"combine_window": 1, "combine_window_max": 512, "pdl": 4}' \
      '{"combine_window": 1, "combine_window_max": 512, "pdl": 4, "combine_window_stages": 3}' \
      --out "$OUT/profile_op_${GPU}_session17a.json" 2>&1 | grep -E "^B=|_kernel"
  ;;
esac
# (appended) run b: where each kernel starts and ends inside a CUDA-graph replay of the op (profile_decode_op.py
# --timeline), for the default (pdl 2), no PDL, pdl 4 (the combine under PDL) and the rotation and window programs in
# launches of their own
#   bash benchmarks/run_session17.sh b
case "$1" in
b)
  timeout 400 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768 --iters 20 --timeline \
      --configs '{}' '{"pdl": 0}' '{"pdl": 4}' '{"fused_prologue": 0}' \
      --out "$OUT/profile_op_${GPU}_session17b.json" 2>&1 | grep -E "^B=|graph:"
  ;;
esac
# (appended) run c: the history kernel's residency again, now with int8 keys and 4 stages (register caps 152 / 144 /
# 136 / 128: 13-16 one-warp programs an SM; session 12 found 144 and 152 slower with the fp16 keys and 2 stages), and
# the wave model's limit of waves (max_waves 2, 3)
#   bash benchmarks/run_session17.sh c
case "$1" in
c)
  timeout 500 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,32x32768,1x131072 --iters 20 \
      --configs '{}' '{"gluon_maxnreg": 152, "gluon_resident": 13}' '{"gluon_maxnreg": 144, "gluon_resident": 14}' \
      '{"gluon_maxnreg": 136, "gluon_resident": 15}' '{"gluon_maxnreg": 128, "gluon_resident": 16}' \
      '{"max_waves": 2}' '{"max_waves": 3}' \
      --out "$OUT/profile_op_${GPU}_session17c.json" 2>&1 | grep -E "^B=|_hist"
  ;;
esac
# (appended) run d: the window programs on a second stream (window_stream: the history kernel waits for the rotation
# alone): its GPU tests (eager and in a CUDA graph), the profile with the graph timeline against the default
#   bash benchmarks/run_session17.sh d
case "$1" in
d)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and (wstream or in_graph) and (decode_op or in_graph)" 2>&1 | tee "$OUT/tests_${GPU}_session17d.log" | tail -2
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768,8x8192 --iters 20 \
      --timeline --configs '{}' '{"window_stream": 1}' '{"window_stream": 1, "gluon_win_split": 128}' \
      --out "$OUT/profile_op_${GPU}_session17d.json" 2>&1 | grep -E "^B=|graph:"
  ;;
esac
# (appended) run e: the combine's latency (the op's idle tail): warps per row program (merge_warps 1 / 2 / 8, R_V in
# 32- or 64-row chunks), alone and with the combine under PDL (pdl 4)
#   bash benchmarks/run_session17.sh e
case "$1" in
e)
  timeout 500 python3 "$R/scripts/profile_decode_op.py" --points 8x131072,1x131072,32x32768,8x8192 --iters 20 \
      --configs '{}' '{"merge_warps": 2}' '{"merge_warps": 2, "merge_cblock": 32}' '{"merge_warps": 1, "merge_cblock": 32}' \
      '{"merge_warps": 8}' '{"pdl": 4}' '{"pdl": 4, "merge_warps": 2}' \
      --out "$OUT/profile_op_${GPU}_session17e.json" 2>&1 | grep -E "^B=|_combine"
  ;;
esac
# (appended) run f: the combine kernel with one warp per row where rows crowd the SMs (merge_one_warp_rows 4: B=32; R_V
# in 16-row chunks, no spills) and pdl 4 (the combine under PDL): GPU tests of the variant that forces both, the
# in-graph test, and the profile against the combine of 4 warps (merge_one_warp_rows 1000) and 32-row chunks
#   bash benchmarks/run_session17.sh f
case "$1" in
f)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "gluon and (pdl4-warp or in_graph) and (decode_op or in_graph)" 2>&1 | tee "$OUT/tests_${GPU}_session17f.log" | tail -2
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 32x32768,32x131072,16x32768,8x131072,1x131072 \
      --iters 20 --configs '{}' '{"merge_one_warp_rows": 1000}' '{"merge_cblock": 32}' '{"pdl": 4}' \
      --out "$OUT/profile_op_${GPU}_session17f.json" 2>&1 | grep -E "^B=|_combine"
  ;;
esac
# (appended) run g (H200) / h (H100): the final tree (one-warp combine where rows crowd the SMs): decode-op GPU tests of
# the Triton path and the default Gluon variants, the kernel benchmark
#   bash benchmarks/run_session17.sh g
case "$1" in
g|h)
  timeout 250 python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" --rootdir "$R" \
      -k "decode_attention_real_shapes or (gluon and decode_op and (k8 or hoist)) or (gluon and in_graph and k8)" 2>&1 \
      | tee "$OUT/tests_${GPU}_session17$1.log" | tail -2
  timeout 200 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session17$1.json" 2>&1 | tee "$OUT/bench_kernels_${GPU}_session17$1.log" | tail -11
  ;;
esac
# (appended) run i: after the review's refactor (one graph-capture helper for bench_kernels.timed and the profile's
# timeline): both scripts at one small point
#   bash benchmarks/run_session17.sh i
case "$1" in
i)
  timeout 120 python3 "$R/scripts/profile_decode_op.py" --points 8x8192 --iters 5 --timeline --configs '{}' \
      --out "$OUT/profile_op_${GPU}_session17i.json" 2>&1 | grep -E "^B=|graph:"
  timeout 120 python3 "$R/scripts/bench_kernels.py" --no-write --batches 8 --lengths 8192 \
      --out "$OUT/kernels_${GPU}_session17i.json" 2>&1 | tail -2
  ;;
esac
