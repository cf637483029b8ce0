#!/usr/bin/env bash
# Session-21 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session21.sh a   # the combine's fixed cost at few rows: R_V prefetched into L2 by the history
#                                        # programs' tails (gluon_rv_prefetch 1, 2: evict-last), the combine's rows
#                                        # split over programs by output channels (merge_out_parts), the prologue's
#                                        # rotation in 16-channel programs (rot_cblock), the combine under PDL (pdl 4);
#                                        # the GPU tests of the new variant first
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" -x \
      "$R/tests/kernels/test_int2_attention.py" -k "gluon and (rvpf-parts or early-pdl2)" \
      2>&1 | tee "$OUT/tests_${GPU}_session21a.log" | tail -3
  timeout 380 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x8192,8x131072 --iters 20 \
      --configs '{}' '{"gluon_rv_prefetch": 1}' '{"gluon_rv_prefetch": 2}' '{"merge_out_parts": 2}' \
      '{"merge_out_parts": 4}' '{"rot_cblock": 16}' '{"gluon_rv_prefetch": 2, "merge_out_parts": 2}' \
      '{"pdl": 4, "gluon_rv_prefetch": 2}' \
      --out "$OUT/profile_op_${GPU}_session21a.json" 2>&1 | grep -E "^B=|_comb|_prol|graph"
  ;;
esac
# (appended) run b (H200): run a's winners together -- merge_out_parts 4 (the combine 6.4 -> 5.5 us at B=1/128K, 5.4
# -> 4.2 at B=1/32K), with the R_V prefetch (evict-last), with the combine under PDL, 4 warps a combine program, 8
# parts -- at seven points
#   bash benchmarks/run_session21.sh b
case "$1" in
b)
  timeout 500 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,1x8192,8x8192,8x131072,16x32768,32x8192 \
      --iters 20 --configs '{}' '{"merge_out_parts": 4}' '{"merge_out_parts": 4, "gluon_rv_prefetch": 2}' \
      '{"merge_out_parts": 4, "gluon_rv_prefetch": 2, "pdl": 4}' '{"merge_out_parts": 4, "pdl": 4}' \
      '{"merge_out_parts": 4, "merge_warps": 4}' '{"merge_out_parts": 8}' \
      --out "$OUT/profile_op_${GPU}_session21b.json" 2>&1 | grep -E "^B=|_comb"
  ;;
esac
# (appended) run c (H200): the combine's tile of a row's splits is a power of two (B=1/128K: 132 splits in a tile of
# 256): the split count rounded down to a power of two within 5% / 10% (splits_pow2_slack), 4 warps a combine program
# where rows are few (merge_warps_few), with merge_out_parts 4, the R_V prefetch and the combine under PDL
#   bash benchmarks/run_session21.sh c
case "$1" in
c)
  P='"merge_out_parts": 4'
  timeout 500 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,1x8192,8x8192,8x131072,16x32768,32x8192 \
      --iters 20 --configs '{}' "{$P}" "{$P, \"splits_pow2_slack\": 0.05}" \
      "{$P, \"splits_pow2_slack\": 0.05, \"merge_warps_few\": 4}" "{$P, \"splits_pow2_slack\": 0.05, \"gluon_rv_prefetch\": 2}" \
      "{$P, \"splits_pow2_slack\": 0.05, \"gluon_rv_prefetch\": 2, \"pdl\": 4}" \
      "{$P, \"splits_pow2_slack\": 0.05, \"merge_warps_few\": 4, \"gluon_rv_prefetch\": 2}" \
      "{$P, \"splits_pow2_slack\": 0.1, \"merge_warps_few\": 4}" \
      --out "$OUT/profile_op_${GPU}_session21c.json" 2>&1 | grep -E "^B=|_comb|_hist|_split"
  ;;
esac
# (appended) run d (H200): the new defaults (merge_out_parts 4, merge_warps_few 4, splits_pow2_slack 0.05 where the
# combine has fewer rows than SMs): the GPU tests of the decode op (Gluon variants incl. "parts1", the old few-row
# combine; the rotating op; the static cache), then the benchmark of the tree
# run e (H100): the same benchmark
#   bash benchmarks/run_session21.sh d
#   bash benchmarks/run_session21.sh e
case "$1" in
d)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_int2_attention.py" "$R/tests/test_static_cache.py" \
      -k "not gluon or early-pdl2 or parts1 or long or pdl4-warp" 2>&1 | tee "$OUT/tests_${GPU}_session21d.log" | tail -3
  timeout 280 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session21d.json" 2>&1 | grep -v -E "Warn|return F" | tail -12
  ;;
e)
  timeout 330 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session21e.json" 2>&1 | grep -v -E "Warn|return F" | tail -12
  # B=1's timeline under the new defaults; the old few-row combine; fp16 keys on the long-split path; pdl 4
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768 --iters 20 --timeline \
      --configs '{}' '{"merge_out_parts": 1, "merge_warps_few": null, "splits_pow2_slack": 0}' '{"gluon_k8": 0}' \
      '{"pdl": 4}' --out "$OUT/profile_op_${GPU}_session21e.json" 2>&1 | grep -E "^B=|graph:|_comb|_hist|_prol|_split"
  ;;
esac
# (appended) run f (H100): B=1/128K's prologue ends at 7.2 us in the graph (4.4 us alone): what it waits for -- the
# history's early loads (gluon_early 0), the window programs (gluon_win_split 32 / 128, 1 stage), no PDL overlap at all
# (pdl 0), fp16 keys (gluon_k8 0), the rotation in a launch of its own (fused_prologue 0)
#   bash benchmarks/run_session21.sh f
case "$1" in
f)
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072 --iters 20 --timeline \
      --configs '{}' '{"gluon_early": 0}' '{"gluon_win_split": 32}' '{"gluon_win_split": 128}' \
      '{"gluon_win_stages": 1}' '{"pdl": 0}' '{"gluon_k8": 0}' '{"fused_prologue": 0}' \
      --out "$OUT/profile_op_${GPU}_session21f.json" 2>&1 | grep -E "^B=|graph:"
  ;;
esac
# (appended) run g (H100): the split count at B=1/128K -- the rounding to 128 splits a row shortened the H100's
# history kernel by ~2.5 us (run e): without it; 7 and 6 resident programs an SM for the wave model (115 / 99 splits);
# fp16 keys with it
#   bash benchmarks/run_session21.sh g
case "$1" in
g)
  timeout 300 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x65536 --iters 20 --timeline \
      --configs '{}' '{"splits_pow2_slack": 0}' '{"gluon_resident_long": 7}' '{"gluon_resident_long": 6}' \
      '{"gluon_resident_long": 7, "gluon_k8": 0}' '{"splits_pow2_slack": 0.3}' \
      --out "$OUT/profile_op_${GPU}_session21g.json" 2>&1 | grep -E "^B=|graph:"
  ;;
esac
# (appended) run h (H200): the split rounding also on the static (device-length) path, merge_warps_few only for a
# tile of <= 128 splits at D = 128: the GPU tests of the decode op (all Gluon variants' device-length, rotating and
# in-graph tests, the static cache), then B=1's profile
#   bash benchmarks/run_session21.sh h
case "$1" in
h)
  timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_int2_attention.py" "$R/tests/test_static_cache.py" \
      -k "device_length or rotating or static or parts1 or early-pdl2" 2>&1 | tee "$OUT/tests_${GPU}_session21h.log" | tail -3
  timeout 150 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072 --iters 20 --configs '{}' \
      --out "$OUT/profile_op_${GPU}_session21h.json" 2>&1 | grep -E "^B=|_comb"
  ;;
esac
# (appended) run i (H100): run h's pytest met its time limit after 210 passed tests (none failed) of
# test_int2_attention.py, before test_static_cache.py: the static cache's GPU tests alone
#   bash benchmarks/run_session21.sh i
case "$1" in
i)
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/test_static_cache.py" \
      2>&1 | tee "$OUT/tests_${GPU}_session21i.log" | tail -3
  ;;
esac
