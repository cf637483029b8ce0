#!/usr/bin/env bash
# Session-20 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session20.sh a   # the cold-L2 flush: the read floor and the op's per-kernel profile + graph
#                                        # timeline at B=1 and B=8 (128K) with the old flush (zero a 256 MB buffer:
#                                        # the timed call pays the write-back of the L2's dirty lines) and the new one
#                                        # (zero it, then read it back)
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  for fl in dirty clean; do
    timeout 150 python3 "$R/scripts/bench_read_floor.py" --batches 1,8 --length 131072 --flush $fl \
        --out "$OUT/read_floor_${GPU}_session20a_$fl.json" 2>&1 | grep -v Warn
    timeout 150 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072 --iters 20 --timeline --flush $fl \
        --out "$OUT/profile_op_${GPU}_session20a_$fl.json" 2>&1 | grep -v Warn
  done
  ;;
esac
# (appended) run b (H200): B=1/128K's knobs again under the clean flush (tuned under the dirty one, which adds ~40% to
# B=1's DRAM traffic): residency, stages, int8 keys, L2 prefetch, splits, PDL; the read floor of the history
# kernel's access pattern at B=1
#   bash benchmarks/run_session20.sh b
case "$1" in
b)
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072 --iters 20 --configs '{}' \
      '{"gluon_resident": 8, "gluon_maxnreg": 255}' '{"gluon_resident": 8, "gluon_maxnreg": 255, "gluon_long_split": 512}' \
      '{"gluon_stages": 4}' '{"gluon_k8": 2}' '{"gluon_l2pf": 0}' '{"gluon_l2pf": 2}' '{"programs_per_sm": 24}' \
      '{"programs_per_sm": 6}' '{"pdl": 4}' '{"gluon_early": 0}' '{"gluon_resident": 4, "gluon_maxnreg": 255}' \
      --out "$OUT/profile_op_${GPU}_session20b.json" 2>&1 | grep -E "^B=|_hist|_comb"
  timeout 150 python3 "$R/scripts/bench_read_floor.py" --batches 1 --length 131072 --pattern \
      --out "$OUT/read_floor_${GPU}_session20b.json" 2>&1 | grep -v -E "Warn|return F"
  ;;
esac
# (appended) run c (H200): run b's best B=1 config is the long-split path (8 programs an SM, int8 keys, 4 stages) for
# splits of >= 512 tokens: the threshold gluon_long_split 2048 (default) / 512 / 256 at eight points, clean flush
#   bash benchmarks/run_session20.sh c
case "$1" in
c)
  timeout 400 python3 "$R/scripts/profile_decode_op.py" \
      --points 1x32768,1x131072,8x8192,8x32768,8x131072,16x32768,32x8192,32x32768 --iters 20 \
      --configs '{}' '{"gluon_long_split": 512}' '{"gluon_long_split": 256}' \
      --out "$OUT/profile_op_${GPU}_session20c.json" 2>&1 | grep -E "^B=|_hist|_comb"
  ;;
esac
# (appended) run d (H200): gluon_long_split 256 as the default: the GPU tests of the Gluon path (the default-like
# variants, "short": the old short-split path, "long", fp16 keys), the write path, the static cache; then the benchmark
# of the tree under the clean flush
# run e (H100): the same benchmark
#   bash benchmarks/run_session20.sh d
#   bash benchmarks/run_session20.sh e
case "$1" in
d)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_int2_attention.py" "$R/tests/kernels/test_write_path.py" "$R/tests/test_static_cache.py" \
      -k "not gluon or early-pdl2 or short or long or fp16-keys" 2>&1 | tee "$OUT/tests_${GPU}_session20d.log" | tail -3
  timeout 280 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session20d.json" 2>&1 | grep -v -E "Warn|return F" | tail -12
  ;;
e)
  timeout 330 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session20e.json" 2>&1 | grep -v -E "Warn|return F" | tail -12
  timeout 200 python3 "$R/scripts/bench_read_floor.py" --batches 1,8 --length 131072 \
      --out "$OUT/read_floor_${GPU}_session20e.json" 2>&1 | grep -v -E "Warn|return F"
  ;;
esac
# (appended) run f (H100: no H200 could be started): B=1/128K's combine (32 query rows: 8 warps a row, the whole [S, D] tile of partials in one
# round) under the clean flush, with the new default: rounds of 128 / 64 splits, 4 / 16 warps, R_V chunks of 32 /
# 128 rows, no hoisting; the graph timeline of the default
#   bash benchmarks/run_session20.sh f
case "$1" in
f)
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072 --iters 20 --timeline --configs '{}' \
      '{"merge_block_few": 128}' '{"merge_block_few": 64}' '{"merge_warps": 4}' '{"merge_warps": 16}' \
      '{"merge_cblock": 32}' '{"merge_cblock": 128}' '{"merge_hoist": 0}' \
      --out "$OUT/profile_op_${GPU}_session20f.json" 2>&1 | grep -E "^B=|_comb|graph:"
  ;;
esac
# (appended) run g: the prologue launch (query rotation + BF16 window programs) takes 23.7 us of B=32/8K's 84.9 (the
# history waits for all of it): window tokens a program (win_split 64 / 256; 128 is used from 8 programs an SM on),
# window pipeline stages 1 / 3, warps 8 / 2 (the prologue's; also the Triton split kernel's), the rotation in a launch
# of its own (fused_prologue 0), at six points
#   bash benchmarks/run_session20.sh g
case "$1" in
g)
  timeout 500 python3 "$R/scripts/profile_decode_op.py" --points 32x8192,32x32768,16x32768,8x8192,8x131072,1x131072 \
      --iters 20 --configs '{}' '{"win_split": 64}' '{"win_split": 256}' '{"gluon_win_stages": 1}' \
      '{"gluon_win_stages": 3}' '{"num_warps": 8}' '{"num_warps": 2}' '{"fused_prologue": 0}' \
      --out "$OUT/profile_op_${GPU}_session20g.json" 2>&1 | grep -E "^B=|_prol|_split|_rot"
  ;;
esac
# (appended) run h (H200, at commit ff888bc, which added gluon_qflag; removed after it): the history programs wait for their own (row, head)'s query flag instead of the whole
# prologue launch (gluon_qflag 1, the new default): GPU tests (decode op from the unrotated query, in a graph, the
# flags cleared after each call, the bounded spin's fallback; variants default / noqflag / short / long), the per-kernel
# profile and timeline against gluon_qflag 0, then the benchmark
#   bash benchmarks/run_session20.sh h
case "$1" in
h)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" -x \
      "$R/tests/kernels/test_int2_attention.py" -k "rotating or query_flag or (gluon and (noqflag or early-pdl2))" \
      2>&1 | tee "$OUT/tests_${GPU}_session20h.log" | tail -3
  timeout 150 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x8192,32x32768,16x32768 \
      --iters 20 --timeline --configs '{}' '{"gluon_qflag": 0}' \
      --out "$OUT/profile_op_${GPU}_session20h.json" 2>&1 | grep -E "^B=|graph:"
  timeout 200 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session20h.json" 2>&1 | grep -v -E "Warn|return F" | tail -10
  ;;
esac
# (appended) run i (H200): B=1/128K on the long-split path (the default since this session): pipeline stages 3 / 6 /
# 8, L2 prefetch 0 / 2, no early loads, 12 programs an SM with it; B=8/128K beside it
#   bash benchmarks/run_session20.sh i
case "$1" in
i)
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072 --iters 20 --configs '{}' \
      '{"gluon_stages_long": 3}' '{"gluon_stages_long": 6}' '{"gluon_stages_long": 8}' '{"gluon_l2pf": 0}' \
      '{"gluon_l2pf": 2}' '{"gluon_early": 0}' '{"gluon_resident_long": 12, "gluon_maxnreg_long": 168}' \
      --out "$OUT/profile_op_${GPU}_session20i.json" 2>&1 | grep -E "^B=|_hist"
  ;;
esac
# (appended) run j (H200): the eager op's host time (cProfile over back-to-back calls)
#   bash benchmarks/run_session20.sh j
case "$1" in
j)
  timeout 200 python3 "$R/scripts/profile_op_host.py" --points 1x8192,8x32768,1x131072 --calls 300 \
      --out "$OUT/host_profile_${GPU}_session20j.txt" 2>&1 | grep -v Warn
  head -c 9000 "$OUT/host_profile_${GPU}_session20j.txt"
  ;;
esac
# (appended) run k (H200): the host code without triton.cdiv / next_power_of_2 (constexpr functions) and with the
# device capability cached: the host profile again, the GPU tests of the decode op (Triton and Gluon paths, default
# variant), the write path, the query rotation and the static cache
#   bash benchmarks/run_session20.sh k
case "$1" in
k)
  timeout 120 python3 "$R/scripts/profile_op_host.py" --points 1x8192,8x32768,1x131072 --calls 300 \
      --out "$OUT/host_profile_${GPU}_session20k.txt" 2>&1 | grep -v Warn
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      "$R/tests/kernels/test_write_path.py" "$R/tests/kernels/test_query_rotation.py" "$R/tests/test_static_cache.py" \
      -k "not gluon or early-pdl2" 2>&1 | tee "$OUT/tests_${GPU}_session20k.log" | tail -3
  ;;
esac
# (appended) run l (H200): the benchmark of the final tree
#   bash benchmarks/run_session20.sh l
case "$1" in
l)
  timeout 330 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session20l.json" 2>&1 | grep -v -E "Warn|return F" | tail -12
  ;;
esac
# (appended) run m (H200, at commit cb88216, which added it; removed after it): the prologue's rotation as one program per (KV head, tile of up to 64 query rows of the batch,
# column block) instead of one per (row, head, column block): GPU tests of the decode op from the unrotated query
# (Gluon default variant, in a graph), the per-kernel profile at six points, the benchmark
#   bash benchmarks/run_session20.sh m
case "$1" in
m)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      "$R/tests/kernels/test_query_rotation.py" -k "rotat and (not gluon or early-pdl2 or long)" 2>&1 \
      | tee "$OUT/tests_${GPU}_session20m.log" | tail -3
  timeout 120 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x8192,32x32768,16x32768 \
      --iters 20 --out "$OUT/profile_op_${GPU}_session20m.json" 2>&1 | grep -E "^B=|_prol"
  timeout 250 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session20m.json" 2>&1 | grep -v -E "Warn|return F" | tail -10
  ;;
esac
