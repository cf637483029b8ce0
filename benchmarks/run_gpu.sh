#!/usr/bin/env bash
# Reproduces the GPU figures that README.md and docs/ publish. From the repository root on a CUDA machine:
#
#   bash benchmarks/run_gpu.sh <mode> [<mode> ...]          results under $OUT (default /tmp/out), <gpu> in every name
#
#   tests            GPU tests (pytest -m gpu; TESTS="<paths>" a subset)       gpu_tests_<gpu>.log
#   kernels          decode op vs BF16 SDPA (B 1/8/32 x 8K/32K/128K) and the   kernels_<gpu>.json, _speedup.png
#                    write path (bench_kernels.py)
#   kernels-keybits  Gemma-3-270M's read: INT2 at group 32 against 3-bit keys   kernels_<gpu>_gemma3_270m_g32.json,
#                    at 32 with values at 128 (B 1/8/32 x 8K/32K)               kernels_<gpu>_gemma3_270m_g32_k3_v128.json
#   heads-read       36 layers' reads with one INT8 retrieval head a layer:     heads_read_<gpu>.json
#                    merged (default), their own combine, one stream, fewer splits (bench_heads_read.py)
#   kernels-dims     the op at other head shapes, B 1/8 x 32K/128K; one shape: kernels_<gpu>_<d64|d256|d256_kv2|
#                    kernels-d64, -d256, -d256-kv2, -d96, -d96-g32, -d512          d96|d96_g32|d512>.json
#   strong           the default call against the strong BF16 (strong_bf16.py): strong_bf16_op_<gpu>.json,
#                    its GPU tests, one layer's read, generate at B=8/32K (with   generate_strong_<gpu>_b<B>_t<T>.json
#                    the 40 GiB capacity), B=1/100K, B=1/1K, B=32/32K on 18 layers (strong-op, -b8, -b1,
#                    -short, -b32: one part each; METHODS=, CAPACITY_METHODS= the 40 GiB rows, e.g.
#                    "bf16-strong oscar oscar-static")
#   default          the default call vs BF16 DynamicCache and compiled         generate_default_<gpu>_b<B>_t<T>.json
#                    StaticCache, B=8/32K, B=1/100K (default-long), B=1, 8 x 1K (default-short)
#   short            B=1 and 8 x 1K: compiled StaticCache and the default call  generate_short_<gpu>_b<B>_t1024.json
#   capacity         throughput at each cache's largest batch in 40 GiB at 32K  capacity_<gpu>_40gib{,_bf16}.json
#   fpheads          8 and 25 INT8 retrieval heads, B=8/32K (fpheads-long:      generate_<gpu>_fpheads_inplace_*.json
#                    25 heads, B=1/100K)
#   skip-layers      the default call with its first 2 layers in BF16, B=8/32K  generate_skip_layers_<gpu>_b8_t32768.json
#   arch-<shape>     other architectures at 32K, B=8, synthetic fill:           generate_arch_<gpu>_<shape>_b<B>_t32768.json
#                    gemma3 (-b1: B=1, prefilled), gptoss, qwen3next, qwen35, llama1b, gemma2, gemma3n, falconh1
#   profile          torch.profiler of the decode step, B=8/32K and B=1/1K;      profile_<gpu>_b<B>_t<T>.json,
#                    profile-fpheads (25 heads vs none), profile-op (the op's    profile_<gpu>_fpheads_inplace_b8_t32768.json,
#                    kernels), profile-host (cProfile; BATCH=, CONTEXT=)        profile_op_<gpu>.json, profile_host_*.json
#   first-call       a fresh process's first generate calls, cold then warm     first_call_<gpu>_<method>_{cold,warm}.json
#                    (METHODS=; ~10 min each); first-call-turns: fresh          first_call_<gpu>_turns.json
#                    processes taking turns (TURNS=2, FIRST_TURN=0, OLD_SITE=)
#   regression       the default call, this tree vs OLD_SITE (an older tree     speed_vs_<OLD_NAME>_<gpu>_b<B>_t<T>.json
#                    laid out as oscar_hf/{kernels,eval}) in turns: B=8/32K (-b8), B=1/100K (-b1),
#                    B=1/1K (-short, not in the default pair)
#   soak             200 generate calls (soak-calls); 32,768 new tokens         soak_{calls,long}_<gpu>.json
#                    (soak-long); serving-soak: 1,000 requests, two models      serving_soak_<gpu>.json
#   serve-load       scripts/serve.py over HTTP (tests/serving/serve_load.py):   serve_load_<gpu>.json
#                    1,000 requests, Qwen3-8B shape; TOKENIZER= (chars: a token a character, the default;
#                    smollm2; or a saved tokenizer's dir), EXTRA=, SUFFIX=
#   serving-fair     BF16 and OSCAR serving, equal settings, 20 GiB at 32K,     serving_fair_<gpu>_20gib_t32768.json,
#                    and compiled BF16 StaticCache at B=4; -conc: 4 x 32K;      generate_bf16_static_<gpu>_b4_t32768.json,
#                    -load: Poisson arrivals (TTFT)                             serving_fair_<gpu>_20gib_{t32768_c4,load}.json
#   serving-prefix   32 requests on one 16K-token prefix: OSCAR shared (eager,  serving_prefix_<gpu>_t16384<SUFFIX>.json
#                    graphed) / not, BF16 (Transformers' sharing); KINDS=, RATE=, REQUESTS=, SUFFIX=, EXTRA=
#                    (EXTRA=--retained: the others after the first has finished); needs 5.20+
#   serving-step     graphed serving step at 24 x 32K, compiled generate B=24   serving_step_<gpu>_t32768_c24.json
#   serving-graphs   the serving step with and without CUDA graphs, 24 x 32K    serving_graphs_<gpu>_t32768_c24.json
#   multigpu, tp, tp-serving  device_map over 2 GPUs; tensor parallelism and   multigpu_<gpu>x2.json, tp_<gpu>x2.json,
#                    continuous batching under it, 2 ranks                      tp_serving_<gpu>x2.json
#
# Each mode fits the device machine's 10-minute command limit but kernels-dims, soak and arch-gemma3: run their
# parts one call each. Copy $OUT's files to benchmarks/results/ to publish them. The device machine cannot
# `pip install -e .`: the package is laid out as it would install (`kernels/` -> `oscar_hf/kernels`, `eval/` ->
# `oscar_hf/eval`) under /tmp/oscar_site on PYTHONPATH, and the scripts run from /tmp, so that the repository's
# top-level `kernels/` folder is never imported as `kernels`.
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,/^# Each mode/p' "$0"; exit 2; }
R=$(cd "$(dirname "$0")/.." && pwd)
SITE=/tmp/oscar_site
rm -rf "$SITE" && mkdir -p "$SITE"
cp -r "$R/oscar_hf" "$SITE/oscar_hf"
cp -r "$R/kernels" "$SITE/oscar_hf/kernels"
cp -r "$R/eval" "$SITE/oscar_hf/eval"
# NVLink multicast stays off for NCCL and symmetric memory (the lent machines do not support it).
export PYTHONPATH=$SITE PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; cd /tmp
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200|A100|B200|L40S" | tr A-Z a-z)
GPU=${GPU:-gpu}
B="$R/benchmarks"
D="$R/tests/distributed"  # the multi-GPU correctness checks
PY=python3
TORCHRUN="$PY -m torch.distributed.run --standalone --nproc-per-node 2"

run() {  # run <name> <command...>: its output to $OUT/<name>.log, the tail to the console
  echo "== $1"; local name=$1; shift
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  grep -v -E "Warn|warn" "$OUT/$name.log" | tail -16; echo "rc=$rc"
}
gen() {  # gen <name> <bench_generate args...>: one process (a second compiled shape in one process recompiles)
  local name=$1; shift; run "$name" $PY "$B/bench_generate.py" "$@" --out "$OUT/$name.json"
}
arch() {  # arch <shape> <batch> <methods> [args...]; METHODS="..." runs others, into a file named after them
  local shape=$1 b=$2 methods=${METHODS:-$3}; shift 3
  gen "generate_arch_${GPU}_${shape}_b${b}_t32768${METHODS:+_${METHODS// /-}}" --shape "$shape" --contexts 32768 \
      --batches "$b" --methods $methods --new-tokens 64 "$@"
}
# 147456 / 27375: BF16's and the default OscarCache's allocated KV bytes per token at 32K (generate_default_*_b8_t32768)
CAP="--bytes-per-token 147456 27375 --kv-budget-gib 40 --capacity-context 32768 --capacity-run"
FAIR="--kinds bf16-graphs oscar-graphs --kv-budget-gib 20 --context 32768 --max-requests 24 --q-padding 8
      --bf16-batch-tokens 8192 --oscar-batch-tokens 8192 --prompt-budget 8192"
STEP24="--kv-budget-gib 20 --prompt-budget 1024 --context 32768 --concurrency 24 --max-requests 24 --new-tokens 64 --q-padding 8"

for what in "$@"; do
  case "$what" in
  tests)
    run "gpu_tests_$GPU" $PY -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" ${TESTS:-$R/tests} ;;
  kernels)
    run "kernels_$GPU" $PY "$B/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 --out "$OUT/kernels_$GPU.json"
    $PY "$B/bench_kernels.py" --plot "$OUT/kernels_$GPU.json" ;;
  kernels-dims|kernels-d*)
    # <tag>:<head_dim>:<q heads>:<kv heads>:<group size>: gpt-oss, Gemma 3 12B, Qwen3-Next, Phi-3-mini (G=48, the
    # default there, and 32), Gemma 4's full layers; BF16 K/V of B=8/128K <= 12.9 GB, < 60 GB with the extra states
    dims="d64:64:64:8:64 d256:256:16:8:64 d256_kv2:256:16:2:64 d96:96:32:32:48 d96_g32:96:32:32:32 d512:512:16:4:64"
    [ "$what" != kernels-dims ] && dims=$(tr ' ' '\n' <<< "$dims" | grep "^$(tr - _ <<< "${what#kernels-}"):")
    for x in $dims; do
      IFS=: read -r tag d hq hk g <<< "$x"
      run "kernels_${GPU}_$tag" $PY "$B/bench_kernels.py" --head-dim "$d" --q-heads "$hq" --kv-heads "$hk" \
          --group-size "$g" --batches 1,8 --lengths 32768,131072 --no-write --out "$OUT/kernels_${GPU}_$tag.json"
      $PY "$B/bench_kernels.py" --plot "$OUT/kernels_${GPU}_$tag.json"
    done ;;
  kernels-keybits)
    # Gemma-3-270M's read (4 query heads, one KV head of 256): INT2 keys and values at group 32 (its shipped
    # artifact's storage) against 3-bit keys at 32 with values at 128, each beside BF16 SDPA; the write path of both
    for x in "g32::2" "g32_k3_v128:--value-group-size 128:3"; do
      IFS=: read -r tag extra kb <<< "$x"
      run "kernels_${GPU}_gemma3_270m_$tag" $PY "$B/bench_kernels.py" --head-dim 256 --q-heads 4 --kv-heads 1 \
          --group-size 32 --key-bits "$kb" $extra --batches 1,8,32 --lengths 8192,32768 --no-write \
          --out "$OUT/kernels_${GPU}_gemma3_270m_$tag.json"
    done ;;
  strong|strong-op|strong-b8|strong-b1|strong-short|strong-b32)
    if [ "$what" = strong ] || [ "$what" = strong-op ]; then
      run "gpu_tests_strong_$GPU" $PY -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/test_strong_bf16.py"
      run "strong_bf16_op_$GPU" $PY "$B/strong_bf16.py" --points 1x1024 1x100000 8x32768 32x32768 \
          --out "$OUT/strong_bf16_op_$GPU.json"
    fi
    m=${METHODS:-bf16-strong oscar oscar-fp25}
    case "$what" in strong|strong-b8) gen "generate_strong_${GPU}_b8_t32768" --contexts 32768 --batches 8 \
        --synthetic-fill --new-tokens 64 --methods $m ${CAP/ 27375/ 0} --capacity-methods ${CAPACITY_METHODS:-bf16-strong oscar} ;; esac
    case "$what" in strong|strong-b1) gen "generate_strong_${GPU}_b1_t100000" --contexts 100000 --batches 1 \
        --synthetic-fill --new-tokens 64 --methods $m ;; esac
    case "$what" in strong|strong-short) gen "generate_strong_${GPU}_b1_t1024" --contexts 1024 --batches 1 \
        --new-tokens 64 --methods $m ;; esac
    # B=32: 18 of Qwen3-8B's 36 layers, where the strong BF16's K/V fits (77 GB; all 36 would need 155 GB)
    case "$what" in strong|strong-b32) gen "generate_strong_${GPU}_b32_t32768_18l" --shape qwen3-8b-18l \
        --contexts 32768 --batches 32 --synthetic-fill --new-tokens 64 --methods $m ;; esac ;;
  default|default-long|default-short)
    shapes="1:1024 8:1024 8:32768 1:100000"
    [ "$what" = default-short ] && shapes="1:1024 8:1024"
    [ "$what" = default-long ] && shapes="8:32768 1:100000"
    for bt in $shapes; do
      gen "generate_default_${GPU}_b${bt%:*}_t${bt#*:}" --contexts ${bt#*:} --batches ${bt%:*} \
          --methods bf16 bf16-static oscar --new-tokens 64
    done ;;
  short)
    for b in 1 8; do
      gen "generate_short_${GPU}_b${b}_t1024" --contexts 1024 --batches $b --methods bf16-static oscar --new-tokens 64
    done ;;
  capacity)
    gen "capacity_${GPU}_40gib" --capacity-only $CAP --synthetic-fill --capacity-methods oscar bf16-static
    gen "capacity_${GPU}_40gib_bf16" --capacity-only $CAP --synthetic-fill --capacity-methods bf16 ;;
  fpheads)  # none, 8 and 25 of 288 heads (25: the most the default 3.0-bit cap admits on this shape)
    gen "generate_${GPU}_fpheads_inplace_t32768" --contexts 32768 --batches 8 --methods oscar oscar-fp8 oscar-fp25 \
        --new-tokens 128 ;;
  fpheads-long)
    gen "generate_${GPU}_fpheads_inplace_b1_t100000" --contexts 100000 --batches 1 --methods oscar oscar-fp25 \
        --new-tokens 64 ;;
  skip-layers)
    gen "generate_skip_layers_${GPU}_b8_t32768" --contexts 32768 --batches 8 --methods oscar oscar-skip2 --new-tokens 64 ;;
  # Synthetic fill where a prefill's masks and activations would not fit 80 GB (the memory sums: run_gpu.sh at 78f7d51)
  arch-gemma3|arch-gemma3-b1|arch-gemma3-b8)
    [ "$what" != arch-gemma3-b8 ] && arch gemma3-12b 1 "bf16 bf16-static oscar-compiled"
    [ "$what" != arch-gemma3-b1 ] && arch gemma3-12b 8 "bf16 bf16-static oscar-compiled" --synthetic-fill ;;
  arch-gptoss) arch gpt-oss-20b 8 "bf16 bf16-static oscar-compiled" --synthetic-fill ;;
  arch-qwen3next) arch qwen3-next-small 8 "bf16 bf16-static oscar-compiled" --synthetic-fill ;;
  arch-qwen35) arch qwen3.5-9b 8 "bf16 bf16-static oscar-compiled" --synthetic-fill ;;
  arch-llama1b) arch llama-3.2-1b 8 "bf16 bf16-static oscar" ;;
  arch-gemma2) arch gemma2-9b 8 "bf16 oscar-eager oscar-compiled" --synthetic-fill ;;
  arch-gemma3n) arch gemma3n-e4b 8 "bf16 oscar-eager oscar-compiled" --synthetic-fill ;;
  arch-falconh1) arch falcon-h1 8 "bf16 oscar-eager oscar-compiled" --synthetic-fill ;;
  heads-read)
    run "heads_read_$GPU" $PY "$B/bench_heads_read.py" --points 1x100000 8x32768 --min-splits 1024 \
        --out "$OUT/heads_read_$GPU.json" ;;
  profile)
    for bt in 8:32768 1:1024; do
      run "profile_${GPU}_b${bt%:*}_t${bt#*:}" $PY "$B/profile_decode.py" --batch ${bt%:*} --context ${bt#*:} \
          --methods oscar bf16-static --out "$OUT/profile_${GPU}_b${bt%:*}_t${bt#*:}.json"
    done ;;
  profile-fpheads)
    run "profile_${GPU}_fpheads_inplace_b8_t32768" $PY "$B/profile_decode.py" --batch 8 --context 32768 --warmup 4 \
        --steps 6 --methods oscar oscar-fp25 --out "$OUT/profile_${GPU}_fpheads_inplace_b8_t32768.json" ;;
  profile-op)
    run "profile_op_$GPU" $PY "$B/profile_decode.py" --op --out "$OUT/profile_op_$GPU.json" ;;
  profile-host)
    b=${BATCH:-8} t=${CONTEXT:-8192}
    for m in ${METHODS:-oscar-fp25 oscar bf16-static}; do  # one process each (one compiled shape per process)
      run "profile_host_${GPU}_${m}_b${b}_t${t}" $PY "$B/profile_decode.py" --host --batch $b --context $t --warmup 8 \
          --steps 10 --methods $m --out "$OUT/profile_host_${GPU}_${m}_b${b}_t${t}.json"
    done ;;
  first-call)
    # a tiny model's compile first, into caches of its own: a fresh machine's first compiling process pays one-time
    # costs (~20 s on the H200) that would otherwise fall on whichever method came first
    c=/tmp/compile_caches_warmup; rm -rf "$c"
    run first_call_warmup env TORCHINDUCTOR_CACHE_DIR="$c/inductor" TRITON_CACHE_DIR="$c/triton" \
        $PY "$B/first_call.py" --shape tiny --context 256 --new-tokens 8 --method oscar --calls 1
    for m in ${METHODS:-bf16 bf16-static oscar oscar-fp25}; do
      c=/tmp/compile_caches_$m; rm -rf "$c"
      for phase in cold warm; do
        n=2; [ $phase = warm ] && n=1
        run "first_call_${GPU}_${m}_${phase}" env TORCHINDUCTOR_CACHE_DIR="$c/inductor" TRITON_CACHE_DIR="$c/triton" \
            $PY "$B/first_call.py" --method "$m" --calls $n --out "$OUT/first_call_${GPU}_${m}_${phase}.json"
      done
    done ;;
  first-call-turns)
    trees=(); [ -n "${OLD_SITE:-}" ] && trees=(--tree "${OLD_NAME:-old}=$OLD_SITE" --tree "new=$SITE")
    run "first_call_${GPU}_turns" $PY "$B/first_call.py" --warmup --turns "${TURNS:-2}" --first-turn "${FIRST_TURN:-0}" \
        --methods ${METHODS:-bf16-static oscar oscar-fp25} "${trees[@]}" --out "$OUT/first_call_${GPU}_turns.json" ;;
  regression|regression-b8|regression-b1|regression-short)
    old=${OLD_SITE:?OLD_SITE=<old tree laid out as oscar_hf/{kernels,eval}>}; tag=${OLD_NAME:-old}
    shapes="8:32768 1:100000"
    [ "$what" = regression-b8 ] && shapes="8:32768"
    [ "$what" = regression-b1 ] && shapes="1:100000"
    [ "$what" = regression-short ] && shapes="1:1024"
    for bt in $shapes; do
      name="speed_vs_${tag}_${GPU}_b${bt%:*}_t${bt#*:}"
      run "$name" $PY "$B/compare_trees.py" --old "$old" --new "$SITE" --old-name "$tag" --turns 2 \
          --out "$OUT/$name.json" -- --contexts ${bt#*:} --batches ${bt%:*} --methods oscar --new-tokens 64
    done ;;
  soak|soak-calls|soak-long)
    [ "$what" != soak-long ] && run "soak_calls_$GPU" $PY "$B/soak.py" --parts calls --out "$OUT/soak_calls_$GPU.json"
    [ "$what" != soak-calls ] && run "soak_long_$GPU" $PY "$B/soak.py" --parts long --out "$OUT/soak_long_$GPU.json" ;;
  serving-soak)
    run "serving_soak_$GPU" $PY "$B/soak.py" --parts serving --out "$OUT/serving_soak_$GPU.json" ;;
  serve-load)  # scripts/serve.py over HTTP: 1,000 requests, Qwen3-8B shape; TOKENIZER: chars (default: a token a
    # character, so that the forced check recovers each stream's tokens exactly), smollm2 or a saved tokenizer's dir
    run "serve_load_$GPU${SUFFIX:-}" $PY "$R/tests/serving/serve_load.py" --profile qwen3-8b \
        --tokenizer "${TOKENIZER:-chars}" --workdir /tmp --out "$OUT/serve_load_$GPU${SUFFIX:-}.json" ${EXTRA:-} ;;
  serving-fair)
    # each at the most requests its budget admits (BF16 4, OSCAR 24); 256 new tokens: every request still decodes when
    # the last prefill ends; then compiled StaticCache generate at its largest batch in the same memory (B=4 x 32K)
    run "serving_fair_${GPU}_20gib_t32768" $PY "$B/bench_serving.py" --parts capacity $FAIR --new-tokens 256 \
        --out "$OUT/serving_fair_${GPU}_20gib_t32768.json"
    gen "generate_bf16_static_${GPU}_b4_t32768" --contexts 32768 --batches 4 --methods bf16-strong bf16-static \
        --new-tokens 32 --synthetic-fill ;;
  serving-prefix)  # the first request alone, the 31 others from its first token on, 4 a second
    run "serving_prefix_${GPU}_t16384${SUFFIX:-}" $PY "$B/bench_serving.py" --parts prefix \
        --kinds ${KINDS:-oscar-shared oscar-shared-graphs oscar bf16} --context 16384 --requests ${REQUESTS:-32} \
        --rate ${RATE:-4} --new-tokens 128 --kv-budget-gib 20 --max-requests 32 --prompt-budget 16448 ${EXTRA:-} \
        --out "$OUT/serving_prefix_${GPU}_t16384${SUFFIX:-}.json" ;;
  serving-fair-conc)
    run "serving_fair_${GPU}_20gib_t32768_c4" $PY "$B/bench_serving.py" --parts capacity $FAIR --concurrency 4 \
        --new-tokens 256 --out "$OUT/serving_fair_${GPU}_20gib_t32768_c4.json" ;;
  serving-fair-load)  # 24 requests of 8K-32K at 0.5/s, 96 new tokens: TTFT p50 / p90
    run "serving_fair_${GPU}_20gib_load" $PY "$B/bench_serving.py" --parts load $FAIR --requests 24 \
        --lengths 8192 16384 32768 --rate 0.5 --new-tokens 96 --out "$OUT/serving_fair_${GPU}_20gib_load.json" ;;
  serving-step)
    run "serving_step_${GPU}_t32768_c24" $PY "$B/bench_serving.py" --parts capacity --kinds oscar-graphs $STEP24 \
        --out "$OUT/serving_step_${GPU}_t32768_c24.json"
    gen "generate_default_${GPU}_b24_t32768" --contexts 32768 --batches 24 --methods oscar --new-tokens 32 --synthetic-fill ;;
  serving-graphs)
    run "serving_graphs_${GPU}_t32768_c24" $PY "$B/bench_serving.py" --parts capacity --kinds oscar oscar-graphs $STEP24 \
        --out "$OUT/serving_graphs_${GPU}_t32768_c24.json" ;;
  multigpu)
    run "multigpu_${GPU}x2" $PY "$D/multigpu_check.py" --out "$OUT/multigpu_${GPU}x2.json" ;;
  tp)
    run "tp_${GPU}x2" $TORCHRUN "$D/tp_check.py" --layers 8 --context 4096 --new-tokens 16 --out "$OUT/tp_${GPU}x2.json" ;;
  tp-serving)
    run "tp_serving_${GPU}x2" $TORCHRUN "$D/tp_serving_check.py" --layers 8 --prompts 2000 700 3100 1500 \
        --new-tokens 32 --sink 64 --recent 256 --group-size 64 --page-size 256 --out "$OUT/tp_serving_${GPU}x2.json" ;;
  *)
    echo "unknown: $what (see the head of $0)"; exit 2 ;;
  esac
done
