#!/usr/bin/env bash
# Session-23 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session23.sh a   # (H100; run b: H200) the int8 key path's query operands built once per (row,
#                                        # KV head) by the prologue (CONFIG["gluon_qpre"]): GPU tests of it, then the
#                                        # B=1/128K per-program timeline and the op's graph time, with and without it
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a|b)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_query_rotation.py" "$R/tests/kernels/test_int2_attention.py" \
      -k "q8 or prologue_query_operands or timestamps or (rotating and (k8 or long or early-pdl2))" \
      2>&1 | tee "$OUT/tests_${GPU}_session23$1.log" | tail -4
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_qpre": 0}' \
      --out "$OUT/timeline_hist_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_qpre": 0}' --out "$OUT/profile_op_${GPU}_session23$1.json" 2>&1 | grep -E "^B=|_hist|_prol"
  ;;
esac
# (appended) run c (H100): run a's timeline: the history programs' setup after the wait 3.6 -> 1.0 us with the
# prologue's operands, but the prologue's 16 group programs end at 8.4-9.0 us instead of 3.5 (the op 46.3 -> 48.3 us;
# B=32/32K prologue 26 -> 44 us: 224 registers a thread (sm_90 compile) for the 64-column tf32x3 product, so fewer
# window programs an SM). Now the product in two halves of D (167 registers); the rotation alone in each variant
# (scripts/bench_query_prologue.py), the timeline and the op with 4 or 8 warps a prologue program
#   bash benchmarks/run_session23.sh c
case "$1" in
c|d)
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_query_rotation.py" \
      "$R/tests/kernels/test_int2_attention.py" -k "q8 or prologue_query_operands" 2>&1 \
      | tee "$OUT/tests_${GPU}_session23$1.log" | tail -2
  timeout 100 python3 "$R/scripts/bench_query_prologue.py" --batches 1,8,32 \
      --out "$OUT/query_prologue_${GPU}_session23$1.json" 2>&1 | grep -E "^B="
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"prologue_warps": 8}' '{"gluon_qpre": 0}' \
      --out "$OUT/timeline_hist_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"prologue_warps": 8}' '{"gluon_qpre": 0}' --out "$OUT/profile_op_${GPU}_session23$1.json" \
      2>&1 | grep -E "^B=|_hist|_prol"
  ;;
esac
# (appended) run e (H100): run c: with the product in two halves the B=32/32K prologue is back to 25.5 us, B=1/128K
# 45.2 vs 45.9 us without the prologue's operands, but its 16 group programs still end at p50 6.9 / max 8.2 us (the
# rotation's 32 programs: 3.3 / 3.6). The group programs now stamp after their product, sigma_g and sums; the
# rotation-alone benchmark with its errors shown
#   bash benchmarks/run_session23.sh e
case "$1" in
e)
  timeout 100 python3 "$R/scripts/bench_query_prologue.py" --batches 1,32 \
      --out "$OUT/query_prologue_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | tail -12
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"prologue_warps": 8}' \
      --out "$OUT/timeline_hist_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | grep -E "^B=|prologue|product"
  ;;
esac
# (appended) run f (H100): run e: the 64-column group programs spend 5.5 us on the product alone (the 32-column
# rotation programs: 3.3 us for everything). Now the operands are built by the rotation's own programs, one plane of
# 32 channels each, with sigma_g from the largest row norm of the query (the same in both planes' programs, no
# exchange between them); GPU tests, the rotation alone, the timeline and the op's graph time with and without it
#   bash benchmarks/run_session23.sh f
case "$1" in
f)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_query_rotation.py" "$R/tests/kernels/test_int2_attention.py" \
      -k "q8 or prologue_query_operands or timestamps or (rotating and (k8 or long or early-pdl2))" \
      2>&1 | tee "$OUT/tests_${GPU}_session23$1.log" | tail -3
  timeout 60 python3 "$R/scripts/bench_query_prologue.py" --batches 1,32 \
      --out "$OUT/query_prologue_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | tail -6
  timeout 120 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_qpre": 0}' \
      --out "$OUT/timeline_hist_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_qpre": 0}' --out "$OUT/profile_op_${GPU}_session23$1.json" 2>&1 | grep -E "^B=|_hist|_prol"
  ;;
esac
# (appended) run g (H100): run f: B=1/128K graph 44.2-44.5 us against 46.0-46.9 without the prologue's operands (the
# rotation's programs end 0.9 us later, at 4.5 us, the history's setup after its wait 3.6 -> 1.3 us); but the
# history's wait ends at 5.9 us with or without them, 1.4-2.3 us after the prologue's last program. Is the release held
# by the history's early copies (9 MB in flight from ~2 us)? The timeline with fewer early stages and without the early
# loads; the operands' test with its errors against the reference
#   bash benchmarks/run_session23.sh g   (run g first ran as "f|g", repeating run f before it, and hit its time limit: rerun as g2)
case "$1" in
g|g2)
  timeout 100 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "prologue_query_operands" 2>&1 | tee "$OUT/tests_${GPU}_session23$1.log" | tail -2
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 2}' '{"gluon_early": 0, "pdl": 0}' \
      --out "$OUT/timeline_hist_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | grep -E "^B=|prologue|waited|ref_step|exit at"
  ;;
esac
# (appended) run g2 (H100): two early stages instead of four release the wait 1 us sooner (4.9 us) but slow the loop
# (24.8 -> 28.9 us, graph 44.4 -> 46.8); without PDL and early loads 46.9. The defaults stay.
# run h (H200): the benchmark of the tree (speedups against SDPA, write path) and the B=1/128K timeline with and
# without the prologue's operands; run i (H200): GPU tests of them and the op's graph time with and without them;
# run j (H100): the benchmark of the tree
#   bash benchmarks/run_session23.sh h
#   bash benchmarks/run_session23.sh i
#   bash benchmarks/run_session23.sh j
case "$1" in
h|j)
  timeout 330 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|return F" | tail -12
  if [ "$1" = h ]; then
    timeout 120 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
        --configs '{}' '{"gluon_qpre": 0}' \
        --out "$OUT/timeline_hist_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | grep -E "^B=|prologue|at  |->"
  fi
  ;;
i)
  timeout 260 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_query_rotation.py" "$R/tests/kernels/test_int2_attention.py" \
      -k "q8 or prologue_query_operands or timestamps or (rotating and (k8 or long or early-pdl2))" \
      2>&1 | tee "$OUT/tests_${GPU}_session23$1.log" | tail -3
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_qpre": 0}' --out "$OUT/profile_op_${GPU}_session23$1.json" 2>&1 | grep -E "^B=|_hist|_prol"
  ;;
esac
# (appended) run k (H100), l (H200): the history's wait is released 1.4 us (H100) / 0.8 us (H200) after the prologue's
# last program; with two pipeline stages (run g2) 1 us sooner. Now the stages stay 4 but only gluon_early_steps of the
# three first steps' copies go out before the wait (the rest right after it); GPU tests of it, the timeline and the op
#   bash benchmarks/run_session23.sh k
case "$1" in
k|l)
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "long-early1 and (rotating or history_partial)" 2>&1 | tee "$OUT/tests_${GPU}_session23$1.log" | tail -2
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_early_steps": 0}' '{"gluon_early_steps": 1}' '{"gluon_early_steps": 2}' \
      --out "$OUT/timeline_hist_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | grep -E "^B=|prologue|waited|ref_step|exit at"
  timeout 150 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192 --iters 10 \
      --configs '{}' '{"gluon_early_steps": 0}' '{"gluon_early_steps": 1}' '{"gluon_early_steps": 2}' \
      --out "$OUT/profile_op_${GPU}_session23$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# Result of run k (H100): the wait is released 0.9-1.0 us sooner (5.1-5.2 us) with 0-2 steps of copies before it, but
# the setup after it takes as much longer (the reference step then waits for its copies): B=1/128K graph 44.1-45.3 us
# against 44.6 (default), B=8/128K 253.2-254.6 against 253.2, B=8/8K 36.8-37.2 against 36.0. Dropped (the option was
# removed again; run l not made).
# (appended) run m (H100): the whole path with the prologue's operands: generate on a random Qwen3-8B-shaped model at
# a context where the decode op takes the Gluon path with int8 keys (B=2 x 8 KV heads x 32K history tokens > 0.5 M),
# kernels against the torch reference semantics (scripts/gpu_validate.py: per-layer attention outputs, logits)
#   bash benchmarks/run_session23.sh m
case "$1" in
m)
  timeout 500 python3 "$R/scripts/gpu_validate.py" --context 32768 --batch 2 --steps 8 --calib-tokens 0 \
      --out "$OUT/gpu_validate_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | cut -c1-600 | tail -6
  ;;
esac
# (appended) run m: tolerance_ok (per-layer attention output within 4.3e-3 of the reference, layer 0; the others
# ~7e-4; logits 5.4% against a 5.7% noise floor). Run n (H100): the same without the prologue's operands, to see
# whether layer 0's 4e-3 is theirs
#   bash benchmarks/run_session23.sh n
case "$1" in
n)
  timeout 500 python3 "$R/scripts/gpu_validate.py" --context 32768 --batch 2 --steps 8 --calib-tokens 0 \
      --config '{"gluon_qpre": 0}' --out "$OUT/gpu_validate_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | cut -c1-600 | tail -3
  ;;
esac
# (appended) run n: the same per-layer errors to the last digit -- with the second row's left padding the attention
# passes a key mask, and the op takes the Triton kernel (the Gluon kernel has no key mask), so runs m and n did not
# exercise the prologue's operands. Run o (H100): without padding (--no-pad), with and without them, counting the
# Gluon launches (gluon_launches in the JSON)
#   bash benchmarks/run_session23.sh o
case "$1" in
o)
  for cfg in '{}' '{"gluon_qpre": 0}'; do
    timeout 250 python3 "$R/scripts/gpu_validate.py" --context 32768 --batch 2 --steps 8 --calib-tokens 0 --no-pad \
        --config "$cfg" --out "$OUT/gpu_validate_${GPU}_session23$1_$(echo "$cfg" | tr -dc 'a-z0-9').json" 2>&1 \
        | grep -v -E "Warn|warn" | cut -c1-300 | tail -2
  done
  ;;
esac
# Result of run o: without padding 324 Gluon launches (all with the prologue's operands), per-layer attention outputs
# within 5.0e-3 of the reference (4.7e-3 with the kernel's own operands), logits 5.6% against a 5.5% noise floor:
# tolerance_ok both.
# (appended) run p (H100): a decode step's mask that only hides each row's left padding now reaches the op as a later
# per-row start without a key mask (oscar_hf.attention._left_padding_only, one host sync per forward): the padded
# gpu_validate of run m, now on the Gluon path
#   bash benchmarks/run_session23.sh p
case "$1" in
p)
  timeout 250 python3 "$R/scripts/gpu_validate.py" --context 32768 --batch 2 --steps 8 --calib-tokens 0 \
      --out "$OUT/gpu_validate_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | cut -c1-300 | tail -2
  ;;
esac
# Result of run p: left_padding true, 324 Gluon launches (all with the prologue's operands), per-layer 4.5e-3 (layer
# 0; median 8.6e-4), logits 5.5% against a 5.7% floor: tolerance_ok.
# (appended) run q (H100), after the review: the plane programs take their product from _rotate_block (its twin
# removed); GPU tests of the operands and the rotating op's int8-key variants, the B=1/128K timeline and the op
#   bash benchmarks/run_session23.sh q
case "$1" in
q)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_query_rotation.py" "$R/tests/kernels/test_int2_attention.py" \
      -k "q8 or prologue_query_operands or timestamps or (rotating and (k8 or long))" \
      2>&1 | tee "$OUT/tests_${GPU}_session23$1.log" | tail -2
  timeout 100 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 --configs '{}' \
      --out "$OUT/timeline_hist_${GPU}_session23$1.json" 2>&1 | grep -v -E "Warn|warn" | grep -E "^B=|prologue|product|waited|ref_step"
  ;;
esac
# Result of run q: B=1/128K graph 44.6 us (as before); its tests hit the command's 200-s limit after 44 passed (the q8
# kernel's and the rotating op's int8-key variants), none failed; run r: the rest by name
case "$1" in
r)
  timeout 150 python3 -m pytest -v -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_query_rotation.py" "$R/tests/kernels/test_int2_attention.py" \
      -k "q8 or prologue_query_operands or timestamps" 2>&1 | grep -E "PASS|FAIL|passed|failed" \
      | tee "$OUT/tests_${GPU}_session23$1.log" | tail -12
  ;;
esac
# Result of run r: 9 passed (the q8 kernel at 1/4/6/8 rows, the prologue's operands end to end, the timestamps).
