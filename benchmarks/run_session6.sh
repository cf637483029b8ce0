#!/usr/bin/env bash
# Session-6 device runs (torch 2.11, triton 3.6, transformers 5.17 there), from the repository root, one
# `run` call each; results were copied from $OUT to benchmarks/results/ afterwards:
#   bash benchmarks/run_session6.sh a   # full-precision (retrieval) heads on the GPU: the kernels on a head subset
#                                       # vs the reference in generate (Qwen3-8B shape), CPU tests on transformers
#                                       # 5.17, GPU kernel tests, decode speed / memory with 8 and 26 fp heads
#   bash benchmarks/run_session6.sh b   # GPU kernel tests (with L2 prefetch), prefetch-distance sweep + decode rows,
#                                       # fp-heads decode speed again (methods interleaved, twice each)
#   bash benchmarks/run_session6.sh c   # final tree (prefetch 4 the default): GPU kernel + StaticOscarCache tests,
#                                       # decode rows B=1,8,32 x 8K,32K,128K
#   bash benchmarks/run_session6.sh d   # tile / warp / split sweep with prefetch 4, decode rows at the winner
#   bash benchmarks/run_session6.sh e   # paired 4-byte metadata loads in the deferred loop: GPU tests + sweep
source benchmarks/device_env.sh
case "$1" in
a)
  python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" --rootdir "$R" 2>&1 | tee "$OUT/tests_session6.log" | tail -3
  python3 -m pytest -q -p no:cacheprovider "$R/tests/test_retrieval_heads.py" "$R/tests/eval/test_needle.py" \
      "$R/tests/eval/test_perplexity.py" -k "not smollm2" --rootdir "$R" 2>&1 | tee -a "$OUT/tests_session6.log" | tail -3
  python3 "$R/scripts/gpu_validate.py" --context 8192 --batch 2 --steps 8 --calib-tokens 0 \
      --full-precision-heads 0:0,5:3,17:1,17:6,35:7 --out "$OUT/gpu_validate_fpheads_h200.json" | tail -c 600
  timeout 400 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 1 8 \
      --methods bf16 oscar oscar-fp8 oscar-fp26 --new-tokens 32 --out "$OUT/generate_fpheads_h200.json" 2>&1 \
      | tee "$OUT/bench_generate_fpheads.log" | grep -v "it/s" | tail -20
  ;;
b)
  python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" --rootdir "$R" 2>&1 | tee "$OUT/tests_session6b.log" | tail -3
  timeout 300 python3 "$R/scripts/bench_kernels.py" --sweep --sweep-set prefetch --no-write --batches 1,8 \
      --lengths 32768,131072 --out "$OUT/kernels_h200_prefetch.json" 2>&1 | tee "$OUT/bench_kernels_prefetch.log" | tail -12
  timeout 240 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 1 \
      --methods oscar oscar-fp8 oscar-fp26 oscar oscar-fp8 oscar-fp26 --new-tokens 48 \
      --out "$OUT/generate_fpheads_h200_repeat.json" 2>&1 | grep -o '"method[^,]*, "batch[^,]*,.\{0,80\}decode_ms_per_token": [0-9.]*'
  ;;
c)
  python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels" "$R/tests/test_static_cache.py" --rootdir "$R" 2>&1 \
      | tee "$OUT/tests_session6c.log" | tail -3
  timeout 420 python3 "$R/scripts/bench_kernels.py" --no-write --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_h200_prefetch_default.json" 2>&1 | tee "$OUT/bench_kernels_prefetch_default.log" | tail -12
  ;;
d)
  timeout 400 python3 "$R/scripts/bench_kernels.py" --sweep --sweep-set tiles-pf --no-write --batches 1,8 \
      --lengths 131072 --out "$OUT/kernels_h200_tiles_pf.json" 2>&1 | tee "$OUT/bench_kernels_tiles_pf.log" | grep -E "sweep|config|^ *[0-9]"
  ;;
e)
  python3 -m pytest -q -p no:cacheprovider -m gpu "$R/tests/kernels/test_int2_attention.py" -k decode_attention \
      --rootdir "$R" 2>&1 | tee "$OUT/tests_session6e.log" | tail -3
  timeout 300 python3 "$R/scripts/bench_kernels.py" --sweep --sweep-set pair --no-write --batches 1,8 \
      --lengths 131072 --out "$OUT/kernels_h200_pair.json" 2>&1 | tee "$OUT/bench_kernels_pair.log" | grep -E "sweep|config|^ *[0-9]"
  ;;
esac
