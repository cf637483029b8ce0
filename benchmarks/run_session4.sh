#!/usr/bin/env bash
# Session-4 device runs (transformers 5.17 there), from the repository root, one `run` call each:
#   bash benchmarks/run_session4.sh a   # nvidia-h200-x2: TP check on both GPUs, then B=8/32K bench (GPU 0) || 32K-token soak (GPU 1)
#   bash benchmarks/run_session4.sh b   # nvidia-h100-x1: capacity run + decode profile
#   bash benchmarks/run_session4.sh c   # nvidia-h100-x1: compiled B=1 rows at 8K / 32K
#   bash benchmarks/run_session4.sh e   # nvidia-h100-x1: capacity run again at a 40 GiB KV budget (48 GiB + weights OOMed)
#   bash benchmarks/run_session4.sh f   # nvidia-h100-x1: BF16 DynamicCache at the same capacity batch, then part c
#   bash benchmarks/run_session4.sh g   # nvidia-h100-x1: the compiled B=1 rows at 32K (recompiling for a 2nd shape failed in f)
#   bash benchmarks/run_session4.sh h   # nvidia-h100-x1: profile of the eager steps at B=1 / 100K (host-bound?)
#   bash benchmarks/run_session4.sh d   # nvidia-h100-x1: one generate call of 32768 new tokens (soak part a)
# Results land in $OUT (copied to benchmarks/results/ afterwards). NVLink multicast stays off.
set -uo pipefail
R=$PWD
export PYTHONPATH=$(bash scripts/device_pythonpath.sh) PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; cd /tmp
nvidia-smi --query-gpu=name,memory.total --format=csv > "$OUT/gpus_$1.txt"
case "$1" in
a)
  timeout 200 python3 -m torch.distributed.run --standalone --nproc-per-node 2 "$R/scripts/tp_check.py" \
      --layers 8 --context 4096 --new-tokens 16 --out "$OUT/tp_h200x2.json" > "$OUT/tp_h200x2.log" 2>&1
  echo "tp rc=$?"
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 8 \
      --methods bf16 oscar-static bf16-static oscar --out "$OUT/generate_h200_b8_t32768.json" > "$OUT/bench_b8.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout 370 python3 "$R/scripts/soak.py" --parts long --out "$OUT/soak_long_h200.json" \
      > "$OUT/soak_long.log" 2>&1 &
  wait
  ;;
b)  # nvidia-h100-x1: capacity at 32K in a 48 GiB KV budget (both compiled), then a decode profile
  timeout 330 python3 "$R/scripts/bench_generate.py" --capacity-only \
      --bytes-per-token 147456 23438 --capacity-run --synthetic-fill --capacity-methods bf16-static oscar-static \
      --kv-budget-gib 48 --capacity-context 32768 --out "$OUT/capacity_h100_48gib.json" > "$OUT/capacity.log" 2>&1
  timeout 240 python3 "$R/scripts/profile_decode.py" --context 32768 \
      --methods oscar-static bf16-static --out "$OUT/profile_h100_t32768.json" > "$OUT/profile.log" 2>&1
  ;;
c)  # nvidia-h100-x1: the compiled batch-1 rows at 8K and 32K
  timeout 570 python3 "$R/scripts/bench_generate.py" --contexts 8192 32768 --batches 1 \
      --methods bf16-static oscar-static --out "$OUT/generate_h100_static_b1.json" > "$OUT/bench_b1.log" 2>&1
  ;;
e)  # nvidia-h100-x1: capacity at 32K in a 40 GiB KV budget (at 48 GiB OSCAR's batch of 67 ran out of memory)
  timeout 500 python3 "$R/scripts/bench_generate.py" --capacity-only \
      --bytes-per-token 147456 23438 --capacity-run --synthetic-fill --capacity-methods oscar-static bf16-static \
      --kv-budget-gib 40 --capacity-context 32768 --out "$OUT/capacity_h100_40gib.json" > "$OUT/capacity40.log" 2>&1
  ;;
f)  # nvidia-h100-x1: BF16 DynamicCache (eager) at BF16's largest batch in 40 GiB, then the compiled B=1 rows
  timeout 150 python3 "$R/scripts/bench_generate.py" --capacity-only \
      --bytes-per-token 147456 23438 --capacity-run --synthetic-fill --capacity-methods bf16 \
      --kv-budget-gib 40 --capacity-context 32768 --out "$OUT/capacity_h100_40gib_bf16.json" > "$OUT/capacity40_bf16.log" 2>&1
  timeout 420 python3 "$R/scripts/bench_generate.py" --contexts 8192 32768 --batches 1 \
      --methods oscar-static bf16-static --out "$OUT/generate_h100_static_b1.json" > "$OUT/bench_b1.log" 2>&1
  ;;
g)  # nvidia-h100-x1: compiled B=1 rows at 32K (automatic dynamic shapes now off in bench_generate)
  timeout 500 python3 "$R/scripts/bench_generate.py" --contexts 32768 --batches 1 \
      --methods oscar-static bf16-static --out "$OUT/generate_h100_static_b1_t32768.json" > "$OUT/bench_b1_32k.log" 2>&1
  ;;
h)  # nvidia-h100-x1: eager decode profile at B=1 / 100K (how busy the GPU is in eager generate)
  timeout 400 python3 "$R/scripts/profile_decode.py" --context 100000 \
      --methods bf16 oscar --out "$OUT/profile_h100_eager_t100000.json" > "$OUT/profile_eager.log" 2>&1
  ;;
d)  # nvidia-h100-x1: soak (a), 32768 new tokens in one call
  timeout 585 python3 "$R/scripts/soak.py" --parts long --out "$OUT/soak_long_h100.json" > "$OUT/soak_long.log" 2>&1
  ;;
esac
tail -n 3 "$OUT"/*.log
