#!/usr/bin/env bash
# Session-24 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session24.sh a   # (H100) where the fused prologue lets the PDL-launched history kernel start
#                                        # (CONFIG["prologue_trigger"]: 1 on entry, 2 the rotation programs after
#                                        # their product, 3 at their end), with 8 pipeline stages on the long-split
#                                        # path, and the combine under PDL: B=1/128K timeline and the op's graph time
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a|b)
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"prologue_trigger": 2}' '{"prologue_trigger": 3}' \
      '{"prologue_trigger": 2, "gluon_stages_long": 8}' \
      --out "$OUT/timeline_hist_${GPU}_session24$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 240 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"prologue_trigger": 2}' '{"prologue_trigger": 3}' \
      '{"prologue_trigger": 2, "gluon_stages_long": 8}' '{"pdl": 4}' '{"pdl": 4, "prologue_trigger": 2}' \
      --out "$OUT/profile_op_${GPU}_session24$1.json" 2>&1 | grep -E "^B=|_hist|_prol|_comb"
  ;;
esac
# (appended) run c (H100): run a: triggering the history's launch later only moves the wait for its first loads
# (entry 1.8 -> 4.6 us, setup after the wait 1.3 -> 3.8 us; B=1/128K 44.5 -> 45.9 us), 8 stages and the combine under
# PDL are no better. The late history entries (p90 4.4 us against p50 1.8) look like the programs that a prologue
# program's registers hold back (4 warps x 159 registers = 2.5 of the 8 one-warp history slots of an SM until it
# exits at ~4.2 us): entry / exit of the programs on SMs that ran a prologue program against the rest, with the
# prologue in 2 warps, in 4 warps under 128 registers, and with 3 window programs a head instead of 5
#   bash benchmarks/run_session24.sh c
case "$1" in
c|d)
  timeout 200 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"prologue_warps": 2}' '{"prologue_maxnreg": 128}' '{"prologue_warps": 2, "prologue_maxnreg": 128}' \
      '{"gluon_win_split": 128}' \
      --out "$OUT/timeline_hist_${GPU}_session24$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"prologue_warps": 2}' '{"prologue_maxnreg": 128}' '{"prologue_warps": 2, "prologue_maxnreg": 128}' \
      '{"gluon_win_split": 128}' \
      --out "$OUT/profile_op_${GPU}_session24$1.json" 2>&1 | grep -E "^B=|_hist|_prol|_comb"
  ;;
esac
# (appended) run e (H100): run c: the late entries are the programs on the 72 SMs that ran a prologue program (entry
# p90 4.6 us against 1.9 on the other 60 SMs), but both groups end alike (exit p50 32.9 / 32.9, max 35.6 / 35.5): the
# spread of the ends is the loop's (ref_step -> loop_end p10 23.8, max 27.8 us), not the entry's; a smaller prologue
# footprint only slows the prologue (2 warps: 45.3 us, 128 registers: 44.3-44.6, both: 49.9; 3 window programs a head:
# 46.8). Now the combine under PDL launched once every history program is past its loop (CONFIG["pdl"] 5: the
# history's programs trigger it after their loop, not on entry as with pdl 4)
#   bash benchmarks/run_session24.sh e
case "$1" in
e|f)
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"pdl": 5}' --out "$OUT/timeline_hist_${GPU}_session24$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"pdl": 5}' '{"pdl": 4}' '{}' '{"pdl": 5}' \
      --out "$OUT/profile_op_${GPU}_session24$1.json" 2>&1 | grep -E "^B=|_hist|_prol|_comb"
  ;;
esac
# (appended) run g (H100): run e: pdl 5 -- the combine under PDL, let go after the history programs' loops -- 44.3-44.6
# against 44.8-45.0 us at B=1/128K, B=8 and B=32 even. Now the history programs of a (row, KV head) wait for a counter
# their 4 rotation programs raise once their operands are stored (CONFIG["gluon_qflag"]: ld.acquire spin), not for
# the prologue grid's completion (griddepcontrol.wait released 1.4 us after the last prologue program's exit); GPU
# tests of it and of pdl 5 / prologue_trigger 2, then the timeline and the op's graph time
#   bash benchmarks/run_session24.sh g
case "$1" in
g|h)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "qflag or ((rotating or history_partial) and (pdl5 or trigger2)) or timestamps" 2>&1 \
      | tee "$OUT/tests_${GPU}_session24$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_qflag": 1}' '{"gluon_qflag": 1, "pdl": 5}' \
      --out "$OUT/timeline_hist_${GPU}_session24$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_qflag": 1}' '{"gluon_qflag": 1, "pdl": 5}' '{}' '{"gluon_qflag": 1, "pdl": 5}' \
      --out "$OUT/profile_op_${GPU}_session24$1.json" 2>&1 | grep -E "^B=|_hist|_prol|_comb"
  ;;
esac
# (appended) run i (H100): run g: gluon_qflag 43.7-43.9 us (B=1/128K; with pdl 5 43.3-44.0) against 44.4-44.7; its
# rotation programs exit ~1 us later (the release's membar waits for their stores), so the wait ends only ~0.2 us
# sooner, but the setup after it is shorter. Now run-time balance of the splits (CONFIG["gluon_steal"]: each split's
# last 8 full steps handed out by ticket to its program and to programs of its (row, head) done with their own):
# GPU tests, the timeline and the op's graph time with tails of 4, 8, 12 steps
#   bash benchmarks/run_session24.sh i
case "$1" in
i|j)
  timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "steal or qflag_counters or (rotating and (qflag or pdl5)) or (reference_guard and steal)" 2>&1 \
      | tee "$OUT/tests_${GPU}_session24$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{"gluon_qflag": 1, "pdl": 5}' '{"gluon_qflag": 1, "pdl": 5, "gluon_steal": 1}' \
      '{"gluon_qflag": 1, "pdl": 5, "gluon_steal": 1, "gluon_steal_tail": 4}' \
      --out "$OUT/timeline_hist_${GPU}_session24$1.json" 2>&1 | grep -v -E "Warn|warn"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,2x131072 --iters 10 \
      --configs '{"gluon_qflag": 1, "pdl": 5}' '{"gluon_qflag": 1, "pdl": 5, "gluon_steal": 1}' \
      '{"gluon_qflag": 1, "pdl": 5, "gluon_steal": 1, "gluon_steal_tail": 4}' \
      '{"gluon_qflag": 1, "pdl": 5, "gluon_steal": 1, "gluon_steal_tail": 12}' '{"gluon_qflag": 1, "pdl": 5}' \
      --out "$OUT/profile_op_${GPU}_session24$1.json" 2>&1 | grep -E "^B=|_hist|_prol|_comb"
  ;;
esac
# (appended) run i's result: run-time balance of the splits by ticket (each split's last 8 full steps taken by ticket by
# its own program and by programs of its (row, head) done with their own) made the loop ~15% slower (ref_step ->
# loop_end p50 24.6 -> 28.4 us: 361 instead of 322 SASS instructions a step for the ticket queue and its branches)
# and did not even out the ends (exits p10 34.6, max 38.4: an owner claims its tail 5 steps ahead, so the thieves,
# done ~3 us after the median, find the tails taken); B=1/128K 43.4-43.9 -> 45.8-47.3 us. Dropped (code removed).
# Defaults now pdl 5 and gluon_qflag 1. Run k (H100): the GPU tests of the decode op's Gluon path; run l (H100) and
# run m (H200): the benchmark of the tree (and on the H200 the timeline)
#   bash benchmarks/run_session24.sh k
case "$1" in
k)
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" \
      "$R/tests/kernels/test_query_rotation.py" "$R/tests/kernels/test_int2_attention.py" \
      -k "qflag or pdl5 or q8 or prologue_query_operands or timestamps or in_graph or (rotating and (k8 or long or early-pdl2))" \
      2>&1 | tee "$OUT/tests_${GPU}_session24$1.log" | tail -4
  ;;
l|m)
  timeout 330 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session24$1.json" 2>&1 | grep -v -E "Warn|return F" | tail -12
  if [ "$1" = m ]; then
    timeout 120 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
        --configs '{}' '{"gluon_qflag": 0, "pdl": 2}' \
        --out "$OUT/timeline_hist_${GPU}_session24$1.json" 2>&1 | grep -v -E "Warn|warn" | grep -E "^B=|prologue|at  |->"
  fi
  ;;
esac
# (appended) run n (H100): end to end with the new defaults (gluon_qflag, pdl 5): kernels against the torch reference
# semantics on a random Qwen3-8B-shaped model at 32K, B=2 with the second row left padded (scripts/gpu_validate.py)
#   bash benchmarks/run_session24.sh n
case "$1" in
n)
  timeout 400 python3 "$R/scripts/gpu_validate.py" --context 32768 --batch 2 --steps 8 --calib-tokens 0 \
      --out "$OUT/gpu_validate_${GPU}_session24$1.json" 2>&1 | grep -v -E "Warn|warn" | cut -c1-400 | tail -6
  ;;
esac
# (appended) run o (H200): the new defaults' GPU tests on the H200 too (the counters, the pdl5 / qflag variants of the
# decode op's Gluon tests, the op in a CUDA graph, the prologue's operands, the timestamps)
#   bash benchmarks/run_session24.sh o
case "$1" in
o)
  timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "qflag or pdl5 or in_graph or prologue_query_operands or timestamps or (rotating and long)" \
      2>&1 | tee "$OUT/tests_${GPU}_session24$1.log" | tail -3
  ;;
esac
# (appended) run p (H100): after the review -- a launch that fails after the prologue raised the counters sets them
# back to 0 (decode_triton._counters_reset_on_error): the counters' test and the qflag / pdl5 variants again
#   bash benchmarks/run_session24.sh p
case "$1" in
p)
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "qflag or pdl5 or in_graph" 2>&1 | tee "$OUT/tests_${GPU}_session24$1.log" | tail -3
  ;;
esac
# (appended) run q (H200): the op's graph time with the session-23 defaults (pdl 2, the PDL wait) against the new ones,
# paired in one run
#   bash benchmarks/run_session24.sh q
case "$1" in
q)
  timeout 240 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{"gluon_qflag": 0, "pdl": 2}' '{}' '{"gluon_qflag": 0, "pdl": 2}' '{}' \
      --out "$OUT/profile_op_${GPU}_session24$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run r (H100): after the final review (_ready_counters' capture case first, one stream wait): the
# counters' test and the op in a CUDA graph with the qflag / pdl5 variants
#   bash benchmarks/run_session24.sh r
case "$1" in
r)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "qflag_counters or (in_graph) or (rotating and qflag)" 2>&1 | tee "$OUT/tests_${GPU}_session24$1.log" | tail -3
  ;;
esac
