#!/usr/bin/env bash
# Reproduces the GPU figures that README.md and docs/ publish. Run from the repository root on a CUDA machine:
#
#   bash benchmarks/run_gpu.sh <what> [<what> ...]     results under $OUT (default /tmp/out)
#
#   tests       the GPU test suite (pytest -m gpu)                      gpu_tests_<gpu>.log
#   kernels     decode op vs BF16 SDPA, B = 1, 8, 32 x 8K, 32K, 128K,   kernels_<gpu>.json, kernels_<gpu>_speedup.png
#               and the write path (bench_kernels.py)
#   kernels-dims  decode op vs BF16 SDPA at other attention shapes,    kernels_<gpu>_d64.json,
#               B = 1, 8 x 32K, 128K (no write path): head_dim 64        kernels_<gpu>_d256.json,
#               (gpt-oss: 64 q / 8 KV heads), 256 (Gemma 3 12B:         kernels_<gpu>_d256_kv2.json,
#               16 / 8; Qwen3-Next: 16 / 2), 96 (Phi-3-mini: 32 / 32,    kernels_<gpu>_d96.json,
#               G=32), 512 (Gemma 4 full layers: 16 / 4) (`kernels-d64`, kernels_<gpu>_d512.json
#               `kernels-d256`, `kernels-d256-kv2`, `kernels-d96`,
#               `kernels-d512`: one shape each)
#   gluon-d64   the Gluon history at head_dim 64 (M <= 4): its GPU      gpu_tests_gluon_d64_<gpu>.log,
#               tests, then the op on the split kernel alone (no Gluon),   kernels_<gpu>_d64_m4_{split,gluon,gluon-all}.json
#               at the defaults and with Gluon at every size (32 / 8
#               heads, B = 1, 8 x 32K, 128K)
#   gluon-d64-groups  D = 64 with 8 query rows (gpt-oss) in two query   gpu_tests_gluon_d64_groups_<gpu>.log,
#               groups: GPU tests, the op on the split kernel alone and   kernels_<gpu>_d64_m8_{split,gluon}.json
#               at the defaults (the Gluon history, two query groups)
#   profile-op  the decode op's kernels one by one in a CUDA graph       profile_op_<gpu>.json
#   strong      the default call against the strong BF16 baseline     gpu_tests_strong_<gpu>.log,
#               (strong_bf16.py), both compiled with CUDA graphs: its     strong_bf16_op_<gpu>.json,
#               GPU tests, one layer's read (split-K kernel and a tile   generate_strong_<gpu>_b<B>_t<T>.json
#               sweep, FlexAttention, exact-length SDPA), then generate,
#               one process per shape (bf16-strong, oscar, oscar-fp25;
#               METHODS="..." others, e.g. bf16-strong-flex): B=8/32K
#               with each at its largest batch in 40 GiB of KV at 32K,
#               B=1/100K, B=1/1K (`strong-op`, `strong-b8`, `strong-b1`,
#               `strong-short`: one part each)
#   default     the default call OscarCache(model) (compiled by        generate_default_<gpu>_b<B>_t<T>.json
#               generate itself) vs BF16 DynamicCache and compiled
#               StaticCache: B=1/100K, B=8/32K, B=1 and 8 at 1K
#               (`default-long`, `default-short`: one call each)
#   arch-gemma3 Gemma 3 12B shape (sliding 5 : full 1, head_dim 256)    generate_arch_<gpu>_<shape>_b<B>_t32768.json
#               at 32K, B=1 (prefill) and B=8 (synthetic fill): BF16     (<shape>: gemma3-12b, gpt-oss-20b,
#               DynamicCache, compiled StaticCache, OscarCache(compile=   qwen3-next-small, qwen3.5-9b, llama-3.2-1b)
#               True) (`arch-gemma3-b1`, `arch-gemma3-b8`: one call each)
#   arch-gptoss gpt-oss-20b shape (sliding / full, sinks, head_dim 64,
#               eager attention), B=8/32K, synthetic fill, same methods
#   arch-qwen3next  Qwen3-Next attention + linear attention (head_dim
#               256; MoE reduced to 64 experts), B=8/32K, synthetic fill
#   arch-qwen35 Qwen3.5-9B text shape (linear 3 : full 1, head_dim 256),
#               B=8/32K, synthetic fill, same methods
#   arch-llama1b  Llama 3.2 1B shape (full attention, head_dim 64),
#               B=8/32K: BF16 DynamicCache, compiled StaticCache, the
#               default call OscarCache(model)
#   arch-gemma2 Gemma 2 9B (soft-capping), `arch-gemma3n` Gemma 3n E4B (KV sharing), `arch-falconh1` Falcon-H1
#               (hybrid attention + Mamba layers): B=8/32K, synthetic fill, BF16 DynamicCache and OscarCache's eager
#               and compiled storage (compile=False / True)
#   first-call  the first generate calls of a fresh process and of a    first_call_<gpu>_<method>_{cold,warm}.json
#               second one with warm on-disk compile caches (B=1, 32K,
#               128 new tokens; METHODS="..." picks methods, default
#               bf16 bf16-static oscar oscar-fp25; ~10 min each)
#   first-call-turns  the same first calls (cold only), the caches     first_call_<gpu>_turns.json
#               taking turns in one process each, the order rotating
#               each turn (TURNS=2, FIRST_TURN=0 the first one's number,
#               MERGE=<an earlier call's report> its runs kept in front;
#               METHODS as above; OLD_SITE adds that tree's runs;
#               WARM_KERNELS=1 runs this tree without and with
#               OSCAR_WARM_KERNELS=1; ~1 min a run): medians and ratios
#   regression  the default call, this tree vs OLD_SITE (an older     speed_vs_<OLD_NAME>_<gpu>_b<B>_t<T>.json
#               tree laid out as oscar_hf/{kernels,eval}), taking turns:
#               B=8/32K, B=1/100K (`regression-b8`, `regression-b1`)
#   skip-layers Qwen3-8B shape, B=8/32K: the default call, and with     generate_skip_layers_<gpu>_b8_t32768.json
#               its first 2 layers kept in full precision (skip_layers)
#               (arch-*: METHODS="..." runs other methods, into a file
#               named after them)
#   generate    compiled generate: B=8/32K (BF16 eager, BF16 static,     generate_<gpu>_b8_t32768.json,
#               StaticOscarCache) and B=1 at 8K, 32K, 100K               generate_<gpu>_static_b1_t{8192,32768,100000}.json
#   eager       eager generate: B=1 at 8K/32K/100K, B=8 at 8K/32K       generate_<gpu>_b1.json, generate_<gpu>_b8.json
#   fpheads     decode cost of 8 and 25 INT8 retrieval heads read in   generate_<gpu>_fpheads_inplace_t32768.json
#               place, B=8/32K (`fpheads-long`: 25 heads, B=1/100K)      generate_<gpu>_fpheads_inplace_b1_t100000.json
#   heads-write-tests  GPU tests of the fused write with retrieval      gpu_tests_heads_write_<gpu>.log
#               heads, the compiled storage and the heads' read
#   quantizer   quantizer="std" vs "minmax": kernel tests, B=8/32K      gpu_tests_quantizer_<gpu>.log,
#               prefill and decode of the default call                  generate_<gpu>_quantizer_t32768.json
#   capacity    aggregate decode throughput at each cache's largest     capacity_<gpu>_40gib.json,
#               batch in a 40 GiB KV budget at 32K                      capacity_<gpu>_40gib_bf16.json
#   profile     torch.profiler of the default call's decode step vs      profile_<gpu>_b8_t32768.json,
#               compiled StaticCache: B=8/32K and B=1/1K                 profile_<gpu>_b1_t1024.json
#   profile-fpheads  the same, the default call with 25 INT8         profile_<gpu>_fpheads_inplace_b8_t32768.json
#               retrieval heads and none, B=8/32K
#   heads-kernel  the retrieval heads' read alone (split + combine) at    heads_kernel_<gpu>.json
#               B=8/32K-capacity shapes, defaults and a tile sweep
#   short       the short-prompt step: compiled BF16 StaticCache and   generate_short_<gpu>_b{1,8}_t1024.json
#               the default call at 1K, B=1 and B=8, both in one process
#               per batch (64 new tokens)
#   append-launch  the decode step's fused write at its launch shapes,  append_launch_<gpu>.json
#               36 layers in one CUDA graph, B=1 and 8 (bench_append.py)
#   profile-host  cProfile of the decode step's host side, B=8/8K       profile_host_<gpu>_<method>_b<B>_t<T>.json
#               (BATCH=, CONTEXT= pick others):
#               no heads, 25 INT8 heads, compiled BF16 StaticCache
#   validate    Triton/Gluon read path vs the torch reference in a      gpu_validate_<gpu>.json
#               32K generate (B=2, left padding): per-layer outputs, logits
#   soak        200 generate calls; one call of 32,768 new tokens        soak_calls_<gpu>.json, soak_long_<gpu>.json
#   multigpu    device_map over 2 GPUs vs one GPU (needs 2 GPUs)         multigpu_<gpu>x2.json
#   tp          tensor parallelism under torchrun, 2 ranks (2 GPUs)      tp_<gpu>x2.json
#   tp-serving  continuous batching (paged_oscar) under tensor           tp_serving_<gpu>x2.json
#               parallelism, 2 ranks: each rank's heads, tokens vs one
#               process (tp_serving_check.py)
#   serving-graphs  the serving decode step with and without CUDA     serving_graphs_<gpu>_t32768_c24.json
#               graphs, 24 requests x 32K
#   paged       the paged decode op's (split and Gluon kernels), the paged  paged_tests_<gpu>.log
#               write's, the pool's and the serving CUDA graphs' tests
#   serving-fair  BF16 and OSCAR serving under equal settings (CUDA     serving_fair_<gpu>_20gib_t32768.json,
#               graphs, 8,192-token steps, pages of 256) in 20 GiB of KV   generate_bf16_static_<gpu>_b4_t32768.json
#               at 32K, each at its capacity; compiled BF16 StaticCache
#               generate at B=4 (its largest batch there)
#   serving-fair-conc  the same settings at equal concurrency (4 x 32K) serving_fair_<gpu>_20gib_t32768_c4.json
#   serving-fair-load  the same settings under Poisson arrivals (24     serving_fair_<gpu>_20gib_load.json
#               requests of 8K-32K at 0.5/s): TTFT p50 / p90
#   serving-soak  1,000 requests with cancellations, two models        serving_soak_<gpu>.json
#               switched every round (serving_soak.py)
#   serving-step  the graphed serving decode step, 24 requests x 32K,    serving_step_<gpu>_t32768_c24.json,
#               and the compiled generate step at B=24/32K (one machine)  generate_default_<gpu>_b24_t32768.json
#
# Each <what> fits in the device machine's 10-minute command limit except `generate`, `eager`, `soak`, `kernels-dims`
# and `arch-gemma3`: run their parts one call each (`generate-b8`, `generate-b1`; `eager-b1`, `eager-b8`; `soak-calls`,
# `soak-long`; `kernels-d64`, `kernels-d256`, `kernels-d256-kv2`, `kernels-d96`, `kernels-d512`; `arch-gemma3-b1`, `arch-gemma3-b8`;
# `CONTEXTS=100000 bash benchmarks/run_gpu.sh generate-b1` runs one of the B=1 contexts). The numbers in
# the docs come from H100 and H200 machines (the GPU name is in every file and file name); copy $OUT's files to
# benchmarks/results/ to publish them.
#
# The device machine cannot `pip install -e .`: the package is laid out as it would install (`kernels/` ->
# `oscar_hf/kernels`, `eval/` -> `oscar_hf/eval`) under /tmp/oscar_site, put on PYTHONPATH, and the scripts run from
# /tmp by absolute path, so that the repository's top-level `kernels/` folder can never be imported as `kernels`.
set -uo pipefail
[ $# -ge 1 ] || { sed -n '2,/^#   paged/p' "$0"; exit 2; }
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
PY=python3

run() {  # run <name> <command...>: its output to $OUT/<name>.log, the tail to the console
  echo "== $1"; local name=$1; shift
  "$@" > "$OUT/$name.log" 2>&1; local rc=$?
  grep -v -E "Warn|warn" "$OUT/$name.log" | tail -16; echo "rc=$rc"
}

arch() {  # arch <shape> <batch> <methods> [bench_generate args...]: one process (a second compiled shape recompiles)
  local shape=$1 b=$2 methods=${METHODS:-$3}; shift 3
  local name="generate_arch_${GPU}_${shape}_b${b}_t32768${METHODS:+_${METHODS// /-}}"
  run "$name" $PY "$B/bench_generate.py" --shape "$shape" --contexts 32768 --batches "$b" --methods $methods \
      --new-tokens 64 "$@" --out "$OUT/$name.json"
}

for what in "$@"; do
  case "$what" in
  tests)
    run "gpu_tests_$GPU" $PY -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests" ;;
  kernels)
    run "kernels_$GPU" $PY "$B/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
        --out "$OUT/kernels_$GPU.json"
    $PY "$B/bench_kernels.py" --plot "$OUT/kernels_$GPU.json" ;;
  kernels-dims|kernels-d64|kernels-d256|kernels-d256-kv2|kernels-d96|kernels-d96-g32|kernels-d512)
    # <tag>:<head_dim>:<q heads>:<kv heads>:<group size>; one process each (4 points, a few minutes). Memory: BF16 K/V
    # of B=8/128K is 2.1 GB at D=64 / 8 KV heads, 8.6 GB at D=256 / 8, 2.1 GB at D=256 / 2, 12.9 GB at D=96 / 32
    # (Phi-3-mini; 64 does not divide 96: G=32), 4.3 GB at D=512 / 4 (Gemma 4's full layers), with up to 3 more states
    # of it for the back-to-back timing (bench_kernels.seq_calls checks what is free): < 60 GB
    # (D=96: G=48, the default group there, and G=32, the per-channel loop)
    dims="d64:64:64:8:64 d256:256:16:8:64 d256_kv2:256:16:2:64 d96:96:32:32:48 d96_g32:96:32:32:32 d512:512:16:4:64"
    t=${what#kernels-}
    case "$what" in kernels-dims) ;; *) dims=$(tr ' ' '\n' <<< "$dims" | grep "^${t//-/_}:" | tr '\n' ' ') ;; esac
    for x in $dims; do
      IFS=: read -r tag d hq hk g <<< "$x"
      run "kernels_${GPU}_$tag" $PY "$B/bench_kernels.py" --head-dim "$d" --q-heads "$hq" --kv-heads "$hk" \
          --group-size "$g" --batches 1,8 --lengths 32768,131072 --no-write --out "$OUT/kernels_${GPU}_$tag.json"
      $PY "$B/bench_kernels.py" --plot "$OUT/kernels_${GPU}_$tag.json"
    done ;;
  gluon-d64)
    # the Gluon history at head_dim 64: its GPU tests, then the op at Llama-3.2-1B's 32 / 8 heads (M = 4) on the split
    # kernel alone (gluon_min_work above any call's work) and at the defaults (the Gluon history)
    run "gpu_tests_gluon_d64_$GPU" $PY -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
        "$R/tests/kernels/test_decode_gpu.py" -k d64
    for kind in split gluon gluon-all; do  # (gluon-all: the Gluon kernel below gluon_min_work too, B=1/32K)
      cfg='{}'; [ $kind = split ] && cfg='{"gluon_min_work": 1000000000000}'; [ $kind = gluon-all ] && cfg='{"gluon_min_work": 0}'
      run "kernels_${GPU}_d64_m4_$kind" $PY "$B/bench_kernels.py" --head-dim 64 --q-heads 32 --kv-heads 8 \
          --batches 1,8 --lengths 32768,131072 --no-write --config "$cfg" --out "$OUT/kernels_${GPU}_d64_m4_$kind.json"
    done ;;
  gluon-d64-groups)
    # D = 64 with 8 query rows (gpt-oss 64 / 8) on the Gluon kernel in two query groups: its GPU tests (contiguous,
    # static, paged, routing), then the op on the split kernel alone (gluon_min_work above any call's) and at the defaults
    run "gpu_tests_gluon_d64_groups_$GPU" $PY -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
        "$R/tests/kernels/test_decode_gpu.py" "$R/tests/kernels/test_paged_decode.py" \
        -k "query_groups or paged_gluon or d64_routing"
    for kind in split gluon; do
      cfg='{}'; [ $kind = split ] && cfg='{"gluon_min_work": 1000000000000}'
      run "kernels_${GPU}_d64_m8_$kind" $PY "$B/bench_kernels.py" --head-dim 64 --q-heads 64 --kv-heads 8 \
          --batches 1,8 --lengths 32768,131072 --no-write --config "$cfg" --out "$OUT/kernels_${GPU}_d64_m8_$kind.json"
    done ;;
  profile-op)
    run "profile_op_$GPU" $PY "$B/profile_decode_op.py" --points 1x131072,8x131072,32x32768,8x8192 --iters 10 \
        --out "$OUT/profile_op_$GPU.json" ;;
  strong|strong-op|strong-b8|strong-b1|strong-short)
    if [ "$what" = strong ] || [ "$what" = strong-op ]; then
      run "gpu_tests_strong_$GPU" $PY -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/test_strong_bf16.py"
      run "strong_bf16_op_$GPU" $PY "$B/strong_bf16.py" --points 1x1024 1x100000 8x32768 32x32768 \
          --out "$OUT/strong_bf16_op_$GPU.json"
    fi
    shapes=""
    case "$what" in strong) shapes="8:32768 1:100000 1:1024" ;; strong-b8) shapes="8:32768" ;;
      strong-b1) shapes="1:100000" ;; strong-short) shapes="1:1024" ;; esac
    for bt in $shapes; do  # (synthetic fill: decode speed does not depend on the values; 1K prefills)
      fill="--synthetic-fill"; [ "${bt#*:}" = 1024 ] && fill=""
      # B=8/32K also runs each at its largest batch in 40 GiB of KV at 32K (BF16 8, its row above; OSCAR 47), from
      # 147456 / 27375 bytes per token: BF16's and the default OscarCache's allocation at 32K (`capacity` above)
      cap=""; [ "$bt" = 8:32768 ] && cap="--capacity-run --bytes-per-token 147456 27375 --kv-budget-gib 40
          --capacity-context 32768 --capacity-methods bf16-strong oscar"
      name="generate_strong_${GPU}_b${bt%:*}_t${bt#*:}"
      run "$name" $PY "$B/bench_generate.py" --contexts ${bt#*:} --batches ${bt%:*} $fill --new-tokens 64 \
          --methods ${METHODS:-bf16-strong oscar oscar-fp25} $cap --out "$OUT/$name.json"
    done ;;
  default|default-long|default-short)
    # one process per shape (a second compiled shape in one process recompiles)
    shapes="1:1024 8:1024 8:32768 1:100000"
    [ "$what" = default-short ] && shapes="1:1024 8:1024"
    [ "$what" = default-long ] && shapes="8:32768 1:100000"
    for bt in $shapes; do
      name="generate_default_${GPU}_b${bt%:*}_t${bt#*:}"
      run "$name" $PY "$B/bench_generate.py" --contexts ${bt#*:} --batches ${bt%:*} \
          --methods bf16 bf16-static oscar --new-tokens 64 --out "$OUT/$name.json"
    done ;;
  arch-gemma3|arch-gemma3-b1|arch-gemma3-b8)
    # Weights 21.9 GiB (11.8 B). BF16 K/V: 8 full layers x 64 KiB/token (2.0 GiB at B=1, 16.0 GiB at B=8 x 32K, the
    # same preallocated by StaticCache), 40 sliding layers x 1024 tokens (0.3 / 2.5 GiB); OSCAR's full layers ~6x less.
    # B=1 prefills the prompt (SDPA; peak ~30 GiB: the sliding layers' [1, 1, 32K, 32K] mask, MLP activations of 32K
    # tokens). At B=8 a prefill would hold a [8, 1, 32K, 32K] mask (8 GiB as bool, up to twice that again as the
    # memory-efficient kernel's float bias) and 22 GiB of MLP activations beside weights and K/V: over 80 GB, so the
    # caches are filled synthetically (decode ~45 GiB)
    [ "$what" != arch-gemma3-b8 ] && arch gemma3-12b 1 "bf16 bf16-static oscar-compiled"
    [ "$what" != arch-gemma3-b1 ] && arch gemma3-12b 8 "bf16 bf16-static oscar-compiled" --synthetic-fill ;;
  arch-gemma2|arch-gemma3n|arch-falconh1)
    # the families compile="auto" kept on the eager storage until measured: soft-capping (Gemma 2 9B: weights 18.5 GiB,
    # BF16 K/V of its 21 full layers 16 KiB/token x 8 x 32K = 10.5 GiB, eager attention), KV sharing (Gemma 3n E4B:
    # 3 OSCAR layers, the store layer and 20 sliding layers), hybrid attention + Mamba layers (Falcon-H1: 32 layers, the
    # torch Mamba path); B=8/32K, synthetic fill: BF16 DynamicCache, OscarCache's eager and compiled storage
    shape=$(sed -e 's/arch-gemma2/gemma2-9b/' -e 's/arch-gemma3n/gemma3n-e4b/' -e 's/arch-falconh1/falcon-h1/' <<< "$what")
    arch "$shape" 8 "bf16 oscar-eager oscar-compiled" --synthetic-fill ;;
  arch-gptoss)
    # Weights 39.0 GiB (20.9 B, 32 experts). BF16 K/V: 12 full layers x 24 KiB/token = 6.0 GiB at B=8 x 32K, 12
    # sliding layers x 128 tokens (24 MiB); eager decode's repeat_kv copies of one full layer's K and V 4 GiB: peak
    # ~50 GiB. Its eager-attention prefill would materialize [8, 64, 32K, 32K] scores (1 TiB in BF16): synthetic fill
    arch gpt-oss-20b 8 "bf16 bf16-static oscar-compiled" --synthetic-fill ;;
  arch-qwen3next)
    # Weights 22.3 GiB (12.0 B: MoE reduced to 64 experts). BF16 K/V: 12 full layers x 24 KiB/token = 6.0 GiB at B=8 x
    # 32K; linear-attention state 36 x 16.5 MiB (fp32 recurrent state): decode peak ~30 GiB. A B=8 x 32K prefill runs
    # Transformers' torch fallback of the chunked delta rule where flash-linear-attention is not installed (~8 fp32
    # [8, 32, 32K, 128] tensors of 4 GiB per layer) and MoE rows for 262K tokens: near 80 GB, synthetic fill
    arch qwen3-next-small 8 "bf16 bf16-static oscar-compiled" --synthetic-fill ;;
  arch-qwen35)
    # Weights 16.7 GiB (9.0 B). BF16 K/V: 8 full layers x 32 KiB/token = 8.0 GiB at B=8 x 32K; linear state 24 x 16.5
    # MiB: decode peak ~27 GiB. Prefill: as arch-qwen3next (plus 18 GiB of MLP activations): synthetic fill
    arch qwen3.5-9b 8 "bf16 bf16-static oscar-compiled" --synthetic-fill ;;
  first-call)
    # a user's first generate calls (Qwen3-8B shape, B=1, 32K prompt, 128 new tokens), per method: a cold process (fresh
    # Inductor / Triton on-disk caches) making two calls, then a warm process (the same caches) making one. A tiny
    # model's compile runs first, into caches of its own: a fresh machine's first torch.compile process also pays
    # one-time costs (bytecode of the compiler's own modules, CUDA's caches; ~20 s on the H200), which would otherwise
    # fall on whichever method came first
    c=/tmp/compile_caches_warmup; rm -rf "$c"
    run first_call_warmup env TORCHINDUCTOR_CACHE_DIR="$c/inductor" TRITON_CACHE_DIR="$c/triton" \
        $PY "$B/bench_first_call.py" --shape tiny --context 256 --new-tokens 8 --method oscar --calls 1
    for m in ${METHODS:-bf16 bf16-static oscar oscar-fp25}; do
      c=/tmp/compile_caches_$m; rm -rf "$c"
      for phase in cold warm; do
        n=2; [ $phase = warm ] && n=1
        run "first_call_${GPU}_${m}_${phase}" env TORCHINDUCTOR_CACHE_DIR="$c/inductor" TRITON_CACHE_DIR="$c/triton" \
            $PY "$B/bench_first_call.py" --method "$m" --calls $n --out "$OUT/first_call_${GPU}_${m}_${phase}.json"
      done
    done ;;
  first-call-turns)
    trees=(); [ -n "${OLD_SITE:-}" ] && trees=(--tree "${OLD_NAME:-old}=$OLD_SITE" --tree "new=$SITE")
    # (WARM_KERNELS=1: this tree without and with the decode kernels compiled ahead, kernels/step_warmup.py)
    [ -n "${WARM_KERNELS:-}" ] && trees+=(--variant plain=OSCAR_WARM_KERNELS=0 --variant warm=OSCAR_WARM_KERNELS=1)
    run "first_call_${GPU}_turns" $PY "$B/first_call_turns.py" --warmup --turns "${TURNS:-2}" --first-turn "${FIRST_TURN:-0}" \
        ${MERGE:+--merge "$MERGE"} --methods ${METHODS:-bf16-static oscar oscar-fp25} "${trees[@]}" --out "$OUT/first_call_${GPU}_turns.json" ;;
  regression|regression-b8|regression-b1)
    # the default call of this tree against an older one (OLD_SITE: that tree laid out as run_gpu.sh lays this one,
    # carried to the machine), taking turns in one process each (compare_trees.py): B=8/32K and B=1/100K
    old=${OLD_SITE:?OLD_SITE=<old tree laid out as oscar_hf/{kernels,eval}>}; tag=${OLD_NAME:-old}
    shapes="8:32768 1:100000"
    [ "$what" = regression-b8 ] && shapes="8:32768"
    [ "$what" = regression-b1 ] && shapes="1:100000"
    for bt in $shapes; do
      name="speed_vs_${tag}_${GPU}_b${bt%:*}_t${bt#*:}"
      run "$name" $PY "$B/compare_trees.py" --old "$old" --new "$SITE" --old-name "$tag" --turns 2 \
          --out "$OUT/$name.json" -- --contexts ${bt#*:} --batches ${bt%:*} --methods oscar --new-tokens 64
    done ;;
  skip-layers)
    # the compiled storage with layers kept in full precision (GrowingLayer): the default call against skip_layers=(0, 1)
    run "generate_skip_layers_${GPU}_b8_t32768" $PY "$B/bench_generate.py" --contexts 32768 --batches 8 \
        --methods oscar oscar-skip2 --new-tokens 64 --out "$OUT/generate_skip_layers_${GPU}_b8_t32768.json" ;;
  arch-llama1b)
    # Weights 2.3 GiB. BF16 K/V: 16 layers x 32 KiB/token = 8.0 GiB at B=8 x 32K. Prefill (causal SDPA, no mask; MLP
    # activations 12 GiB): peak ~25 GiB
    arch llama-3.2-1b 8 "bf16 bf16-static oscar" ;;
  generate|generate-b8|generate-b1)
    if [ "$what" != generate-b1 ]; then
      run "generate_${GPU}_b8_t32768" $PY "$B/bench_generate.py" --contexts 32768 --batches 8 \
          --methods bf16 oscar-static bf16-static --out "$OUT/generate_${GPU}_b8_t32768.json"
    fi
    if [ "$what" != generate-b8 ]; then
      for t in ${CONTEXTS:-8192 32768 100000}; do  # one process per shape: a second compiled shape in one process recompiles
        run "generate_${GPU}_static_b1_t$t" $PY "$B/bench_generate.py" --contexts $t --batches 1 \
            --methods bf16-static oscar-static --new-tokens 32 --out "$OUT/generate_${GPU}_static_b1_t$t.json"
      done
    fi ;;
  eager|eager-b1|eager-b8)
    if [ "$what" != eager-b8 ]; then
      run "generate_${GPU}_b1" $PY "$B/bench_generate.py" --contexts 8192 32768 100000 --batches 1 \
          --new-tokens 24 --out "$OUT/generate_${GPU}_b1.json"
    fi
    if [ "$what" != eager-b1 ]; then
      run "generate_${GPU}_b8" $PY "$B/bench_generate.py" --contexts 8192 32768 --batches 8 \
          --new-tokens 24 --out "$OUT/generate_${GPU}_b8.json"
    fi ;;
  fpheads)
    # the retrieval heads' cost as the library stores and reads them (INT8 codes read in place): none, 8 and 25 heads
    # of 288 (25: the most the default 3.0-bit cap admits on this shape), B=8/32K, one process (about 5 minutes).
    # generate_<gpu>_fpheads_int8_t32768.json (the dequantize + matmul read it replaced) came from --methods oscar
    # oscar-fp8 oscar-fp8-int4 oscar-fp8-bf16 --new-tokens 48 on the tree before kernels/heads_triton.py
    run "generate_${GPU}_fpheads_inplace_t32768" $PY "$B/bench_generate.py" --contexts 32768 --batches 8 \
        --methods oscar oscar-fp8 oscar-fp25 --new-tokens 128 --out "$OUT/generate_${GPU}_fpheads_inplace_t32768.json" ;;
  fpheads-long)
    # the same at B=1/100K: none and 25 INT8 heads (about 4 minutes)
    run "generate_${GPU}_fpheads_inplace_b1_t100000" $PY "$B/bench_generate.py" --contexts 100000 --batches 1 \
        --methods oscar oscar-fp25 --new-tokens 64 --out "$OUT/generate_${GPU}_fpheads_inplace_b1_t100000.json" ;;
  heads-write-tests)
    # the fused write's retrieval-heads part and the compiled storage on the GPU
    run "gpu_tests_heads_write_$GPU" $PY -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
        "$R/tests/kernels/test_append_token.py" "$R/tests/cache" "$R/tests/kernels/test_heads_attention.py" ;;
  quantizer)
    # OscarConfig.quantizer="std" against the default "minmax": its kernels against the reference (write, append,
    # compiled static cache), then the default call's prefill and decode with each, twice, interleaved
    run "gpu_tests_quantizer_$GPU" $PY -m pytest -q -m gpu -k "real_shapes or gpu_kernel_matches or cuda_graphs" \
        "$R/tests/kernels/test_write_path.py" "$R/tests/kernels/test_append_token.py" \
        "$R/tests/cache/test_static_cache.py" --rootdir "$R" -p no:cacheprovider
    run "generate_${GPU}_quantizer_t32768" $PY "$B/bench_generate.py" --contexts 32768 --batches 8 \
        --methods oscar oscar-std oscar oscar-std --new-tokens 48 --out "$OUT/generate_${GPU}_quantizer_t32768.json" ;;
  capacity)
    # 147456 / 27375 bytes per token: BF16 and the default OscarCache's allocated KV (headroom included) of the
    # Qwen3-8B shape at 32K, measured by `default` (generate_default_<gpu>_b8_t32768.json)
    run "capacity_${GPU}_40gib" $PY "$B/bench_generate.py" --capacity-only --bytes-per-token 147456 27375 \
        --capacity-run --synthetic-fill --capacity-methods oscar bf16-static --kv-budget-gib 40 \
        --capacity-context 32768 --out "$OUT/capacity_${GPU}_40gib.json"
    run "capacity_${GPU}_40gib_bf16" $PY "$B/bench_generate.py" --capacity-only --bytes-per-token 147456 27375 \
        --capacity-run --synthetic-fill --capacity-methods bf16 --kv-budget-gib 40 --capacity-context 32768 \
        --out "$OUT/capacity_${GPU}_40gib_bf16.json" ;;
  profile)
    # the default call (compiled by generate) against compiled BF16 StaticCache, one decode step
    for bt in 8:32768 1:1024; do
      run "profile_${GPU}_b${bt%:*}_t${bt#*:}" $PY "$B/profile_decode.py" --batch ${bt%:*} --context ${bt#*:} \
          --methods oscar bf16-static --out "$OUT/profile_${GPU}_b${bt%:*}_t${bt#*:}.json"
    done ;;
  profile-fpheads)
    # where 25 INT8 retrieval heads' decode time goes (B=8/32K), against none
    run "profile_${GPU}_fpheads_inplace_b8_t32768" $PY "$B/profile_decode.py" --batch 8 --context 32768 --warmup 4 \
        --steps 6 --methods oscar oscar-fp25 --out "$OUT/profile_${GPU}_fpheads_inplace_b8_t32768.json" ;;
  heads-kernel)
    run "heads_kernel_$GPU" $PY "$B/bench_heads.py" --sweep --out "$OUT/heads_kernel_$GPU.json" ;;
  short)
    for b in 1 8; do
      run "generate_short_${GPU}_b${b}_t1024" $PY "$B/bench_generate.py" --contexts 1024 --batches $b \
          --methods bf16-static oscar --new-tokens 64 --out "$OUT/generate_short_${GPU}_b${b}_t1024.json"
    done ;;
  append-launch)
    run "append_launch_$GPU" $PY "$B/bench_append.py" --batches 1 8 --out "$OUT/append_launch_$GPU.json" ;;
  profile-host)
    b=${BATCH:-8} t=${CONTEXT:-8192}  # (BATCH=1 CONTEXT=1024: the short-prompt step)
    for m in ${METHODS:-oscar-fp25 oscar bf16-static}; do  # one process each (one compiled shape per process)
      run "profile_host_${GPU}_${m}_b${b}_t${t}" $PY "$B/profile_decode.py" --host --batch $b --context $t --warmup 8 \
          --steps 10 --methods $m --out "$OUT/profile_host_${GPU}_${m}_b${b}_t${t}.json"
    done ;;
  validate)
    run "gpu_validate_$GPU" $PY "$B/gpu_validate.py" --context 32768 --batch 2 --steps 8 --calib-tokens 0 \
        --out "$OUT/gpu_validate_$GPU.json" ;;
  soak|soak-calls|soak-long)
    [ "$what" != soak-long ] && run "soak_calls_$GPU" $PY "$B/soak.py" --parts calls --out "$OUT/soak_calls_$GPU.json"
    [ "$what" != soak-calls ] && run "soak_long_$GPU" $PY "$B/soak.py" --parts long --out "$OUT/soak_long_$GPU.json" ;;
  multigpu)
    run "multigpu_${GPU}x2" $PY "$B/multigpu_check.py" --out "$OUT/multigpu_${GPU}x2.json" ;;
  tp)
    run "tp_${GPU}x2" $PY -m torch.distributed.run --standalone --nproc-per-node 2 "$B/tp_check.py" \
        --layers 8 --context 4096 --new-tokens 16 --out "$OUT/tp_${GPU}x2.json" ;;
  tp-serving)
    run "tp_serving_${GPU}x2" $PY -m torch.distributed.run --standalone --nproc-per-node 2 "$B/tp_serving_check.py" \
        --layers 8 --prompts 2000 700 3100 1500 --new-tokens 32 --sink 64 --recent 256 --group-size 64 --page-size 256 \
        --out "$OUT/tp_serving_${GPU}x2.json" ;;
  serving-fair)
    # equal settings for BF16 and OSCAR serving in a 20 GiB KV budget at 32K: Transformers' CUDA graphs for both, the same
    # step budget (8,192 tokens) and page size (256), each at the most requests its budget admits (BF16 4, OSCAR 24
    # window slots); then the best single-process BF16 alternative, compiled StaticCache generate at its largest batch
    # in the same memory (B=4 x 32K), decode step only (synthetic fill). 256 new tokens: every request still decodes when
    # the last prefill ends (OSCAR's 24 x 32K prompts are 96 steps of 8,192 tokens; with 64, at most 16 decoded at once)
    run "serving_fair_${GPU}_20gib_t32768" $PY "$B/bench_serving.py" --parts capacity --kinds bf16-graphs oscar-graphs \
        --kv-budget-gib 20 --context 32768 --max-requests 24 --new-tokens 256 --q-padding 8 --bf16-batch-tokens 8192 \
        --oscar-batch-tokens 8192 --prompt-budget 8192 --out "$OUT/serving_fair_${GPU}_20gib_t32768.json"
    run "generate_bf16_static_${GPU}_b4_t32768" $PY "$B/bench_generate.py" --contexts 32768 --batches 4 \
        --methods bf16-strong bf16-static --new-tokens 32 --synthetic-fill --out "$OUT/generate_bf16_static_${GPU}_b4_t32768.json" ;;
  serving-fair-conc|serving-fair-load)
    # the rest of the equal-settings comparison (serving-fair's flags): both at equal concurrency (4 requests x 32K, what
    # BF16's budget admits), and under Poisson arrivals (24 requests of 8K-32K at 0.5/s, 96 new tokens: TTFT p50 / p90)
    fair="--kinds bf16-graphs oscar-graphs --kv-budget-gib 20 --context 32768 --max-requests 24 --q-padding 8
          --bf16-batch-tokens 8192 --oscar-batch-tokens 8192 --prompt-budget 8192"
    if [ "$what" = serving-fair-conc ]; then
      run "serving_fair_${GPU}_20gib_t32768_c4" $PY "$B/bench_serving.py" --parts capacity $fair --concurrency 4 \
          --new-tokens 256 --out "$OUT/serving_fair_${GPU}_20gib_t32768_c4.json"
    else
      run "serving_fair_${GPU}_20gib_load" $PY "$B/bench_serving.py" --parts load $fair --requests 24 \
          --lengths 8192 16384 32768 --rate 0.5 --new-tokens 96 --out "$OUT/serving_fair_${GPU}_20gib_load.json"
    fi ;;
  serving-soak)
    run "serving_soak_$GPU" $PY "$B/serving_soak.py" --out "$OUT/serving_soak_$GPU.json" ;;
  serving-graphs)
    # the serving decode step with Transformers' CUDA graphs against without, 24 requests x 32K (Qwen3-8B shape)
    run "serving_graphs_${GPU}_t32768_c24" $PY "$B/bench_serving.py" --parts capacity --kinds oscar oscar-graphs \
        --kv-budget-gib 20 --prompt-budget 1024 --context 32768 --concurrency 24 --max-requests 24 --new-tokens 64 \
        --q-padding 8 --out "$OUT/serving_graphs_${GPU}_t32768_c24.json" ;;
  paged)
    run "paged_tests_$GPU" $PY -m pytest -q -p no:cacheprovider --rootdir "$R" "$R/tests/kernels/test_paged_decode.py" \
        "$R/tests/kernels/test_paged_append.py" "$R/tests/serving/test_pool.py" "$R/tests/serving/test_cuda_graphs.py" ;;
  serving-step)
    # the graphed serving decode step at 24 requests x 32K against the compiled generate step at B=24/32K, one machine
    run "serving_step_${GPU}_t32768_c24" $PY "$B/bench_serving.py" --parts capacity --kinds oscar-graphs \
        --kv-budget-gib 20 --prompt-budget 1024 --context 32768 --concurrency 24 --max-requests 24 --new-tokens 64 \
        --q-padding 8 --out "$OUT/serving_step_${GPU}_t32768_c24.json"
    run "generate_default_${GPU}_b24_t32768" $PY "$B/bench_generate.py" --contexts 32768 --batches 24 --methods oscar \
        --new-tokens 32 --synthetic-fill --out "$OUT/generate_default_${GPU}_b24_t32768.json" ;;
  *)
    echo "unknown: $what (see the head of $0)"; exit 2 ;;
  esac
done
