#!/usr/bin/env bash
# Session-27 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session27.sh a   # the prologue -> history counters one 128-byte line each and a longer poll
#                                        # sleep (CONFIG["gluon_qflag_stride"], ["gluon_qflag_sleep"]): their GPU
#                                        # tests, the B=1/128K timeline, the op's graph time at the benchmark's
#                                        # corners paired with the defaults; the fixed-cost probe
#                                        # (scripts/probe_fixed_costs.py: the rotation's first load under four
#                                        # flushes, a graph's trivial launches)
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "qflag_counters or timestamps" 2>&1 | tee "$OUT/tests_${GPU}_session27$1.log" | tail -3
  timeout 120 python3 "$R/scripts/probe_fixed_costs.py" --out "$OUT/probe_fixed_costs_${GPU}_session27$1.json" 2>&1 \
      | grep -E "^loads|^graph"
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_qflag_stride": 32}' '{"gluon_qflag_stride": 32, "gluon_qflag_sleep": 128}' \
      '{"gluon_qflag_sleep": 256}' \
      --out "$OUT/timeline_hist_${GPU}_session27$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_qflag_stride": 32}' '{"gluon_qflag_stride": 32, "gluon_qflag_sleep": 128}' \
      '{"gluon_qflag_sleep": 256}' '{}' '{"gluon_qflag_stride": 32}' \
      --out "$OUT/profile_op_${GPU}_session27$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run a's result (H100): 3 GPU tests passed. The counters' spacing and the poll's sleep change nothing
# beyond noise: B=1/128K graph 43.0-43.6 us (stride 32, sleep 128 or 256) against 42.7-43.7, the history's wait ending
# at p50 5.6 (packed) / 5.9-6.0 us; B=8/128K, B=8/8K, B=32/32K within +-0.5%. The probe: one round of a rotation
# program's loads after the clean flush takes 1.5 us (p50; 0.75 hot), the same after a 64 MB flush or with the pages'
# translations warm (no TLB cost); a graph replay of 1 / 2 / 3 trivial launches 4.1 / 5.7 / 7.6 us. Run b: where the
# rotation's ~3 us before its product go (product by each tl.dot precision and by FMAs; with its data in L2 but its
# code cold; hot)
#   bash benchmarks/run_session27.sh b
case "$1" in
b)
  timeout 200 python3 "$R/scripts/probe_fixed_costs.py" --out "$OUT/probe_fixed_costs_${GPU}_session27$1.json" 2>&1 \
      | grep -E "^loads|^graph|^rotation"
  ;;
esac
# (appended) run b's result (H100, probe_fixed_costs_h100_session27b.json): a rotation program's entry -> product
# after the clean flush, p50: tl.dot tf32x3 (the prologue's) 2.75 us, tf32 2.0, ieee 2.25, float32 FMAs 1.75 (max rel.
# error 4e-7 / 4e-4 / 3e-7 / 2e-7); tf32x3 with its data in L2 but its code cold 2.5, hot 2.25. Run c: the prologue's
# rotation product in FMAs (CONFIG["rotation_fma"]): GPU tests, the B=1/128K timeline, the op's graph time paired
#   bash benchmarks/run_session27.sh c
case "$1" in
c|d)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_query_rotation.py" \
      "$R/tests/kernels/test_int2_attention.py" -k "q8 or rotfma or qflag_counters" 2>&1 \
      | tee "$OUT/tests_${GPU}_session27$1.log" | tail -3
  timeout 120 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"rotation_fma": 1}' \
      --out "$OUT/timeline_hist_${GPU}_session27$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"rotation_fma": 1}' '{}' '{"rotation_fma": 1}' \
      --out "$OUT/profile_op_${GPU}_session27$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run c's result (H100): 35 GPU tests passed (the operands by both products, the op's rotfma variant, the
# counters). But the op's rotation programs got their product at 7.2 us instead of 3.3 (exit 8.2 against 4.9), B=1/128K
# graph 46.5-46.8 against 42.9-43.9 us: the FMA product summed 4 chunks of 32 k, each loaded after the last one's sum,
# whose barriers the loads could not move above -- 4 round trips. Now every load comes first (2 halves of k; sm_90
# SASS: all 41 LDG before the first BAR). Run d: the same as c
#   bash benchmarks/run_session27.sh d
# (appended) run d's result (H100): 35 GPU tests passed. With every load first the FMA product comes at p50 3.1 us
# (3.6 with tl.dot in the same run, 3.3 in run c), not 1.75 as in the probe: in the op the rotation's loads share the
# memory with the window programs' and the history's first copies (launched at 1.3 us). The rotation programs' exit
# (4.9 against 5.1) and the history's wait (p50 5.9 both) do not move; B=1/128K graph 43.3-43.6 against 43.1-43.7 us,
# the other corners within noise. Run e: the prologue lets the history launch start later (CONFIG["prologue_trigger"]
# 1: once the rotation programs have their product, 2: once they raised their counters), so that the history's first
# copies do not slow the rotation's loads
#   bash benchmarks/run_session27.sh e
case "$1" in
e)
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "trig or qflag_counters" 2>&1 | tee "$OUT/tests_${GPU}_session27$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"prologue_trigger": 1}' '{"prologue_trigger": 2}' '{"prologue_trigger": 1, "rotation_fma": 1}' \
      --out "$OUT/timeline_hist_${GPU}_session27$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"prologue_trigger": 1}' '{"prologue_trigger": 2}' '{"prologue_trigger": 1, "rotation_fma": 1}' \
      '{}' '{"prologue_trigger": 1, "rotation_fma": 1}' \
      --out "$OUT/profile_op_${GPU}_session27$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run e's result (H100): 52 GPU tests passed (the trig1 / trig2 variants of the decode op, the counters).
# Uncontended, the rotation programs end sooner (exit p50 4.1 us, 3.6 with the FMA product, against 5.0) but the
# history enters only at 4.1-5.1 us (the launch ~1.5 us after the last trigger) and its programs' polls then queue
# behind their own first copies (entry -> wait end p50 4.35 us although the counters were already up): wait end p50
# 8.4-9.5 against 5.8, B=1/128K graph 44.8-45.9 against 42.8-43.7 us (B=8 and B=32 within noise).
# Runs a-e ran code that was removed afterwards (the knobs gluon_qflag_stride / gluon_qflag_sleep, rotation_fma,
# prologue_trigger): run a at e0bf973, b at 829b6e5, c at 078e97f, d at 3bf246f, e at dc28500; `git checkout <commit>`
# to run them again. scripts/probe_fixed_costs.py stays (runs a, b).
# Run f: fewer of the history's first copies before its wait for the query operands (CONFIG["gluon_early_copies"]
# 0, 1, 2 of the 3; the rest issued once the operands' loads are out), so that the handoff's polls and loads queue
# behind fewer copies
#   bash benchmarks/run_session27.sh f
case "$1" in
f)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "fewcopies" 2>&1 | tee "$OUT/tests_${GPU}_session27$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_early_copies": 0}' '{"gluon_early_copies": 1}' '{"gluon_early_copies": 2}' \
      --out "$OUT/timeline_hist_${GPU}_session27$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 220 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_early_copies": 0}' '{"gluon_early_copies": 1}' '{"gluon_early_copies": 2}' \
      '{}' '{"gluon_early_copies": 1}' \
      --out "$OUT/profile_op_${GPU}_session27$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run f's result (H100; the run script still had run e's block under "e|f", so run f first ran that block
# too -- its prologue_trigger / rotation_fma keys were no-ops by then, so it timed the defaults: B=1/128K graph
# 42.9-44.0 us in the 8 measurements its output shows; its files were overwritten by run f's own): 50 GPU tests passed (the decode op's
# fewcopies0 / fewcopies1 variants). Fewer first copies before the wait end it sooner (p50 5.1 against 5.9 us) and
# start the loop sooner (ref_step p50 6.1 against 6.9), but the loop then takes longer (ref_step -> loop_end p50
# 25.3-26.0 against 24.6 us) and ends later (max 35.3-35.8 against 34.9): B=1/128K graph 44.1-44.2 (0 or 1 of the 3
# copies early) / 43.2-43.7 (2) against 42.6-43.6 us; B=8/128K 249.1-250.9 against 249.8, B=8/8K 36.5-36.9 against
# 36.2-36.6, B=32/32K within 0.3%. The
# early copies are worth more than the sooner handoff: the HBM's time is what ends the op. Removed (run f ran at
# 1315bd2; its block is above; run e's is now under "e" alone).
# Run g: can a Triton-compiled kernel (num_ctas 1) run as thread-block clusters and exchange through distributed
# shared memory here (scripts/probe_cluster.py: launched through cuLaunchKernelEx with a cluster dimension; eagerly,
# under PDL, from a CUDA graph)?
#   bash benchmarks/run_session27.sh g
case "$1" in
g)
  timeout 120 python3 "$R/scripts/probe_cluster.py" --out "$OUT/probe_cluster_${GPU}_session27$1.json" 2>&1 | tail -8
  ;;
esac
# (appended) run g's result (H100, probe_cluster_h100_session27g.json): yes. The probe kernel (num_ctas 1) launched
# through cuLaunchKernelEx as 256 clusters of 4 exchanged its words through DSMEM correctly, eagerly, under PDL and
# replayed from a CUDA graph; an exchange (two cluster barriers and one DSMEM load) took p50 1.2 us the first time
# (the cluster's CTAs not yet in step) and 1.0 us the second. Run h (proxy for a clustered history): the history
# kernel as it is, launched as clusters of 2 or 4 CTAs (CONFIG["gluon_cluster"]: Triton's launcher told num_ctas =
# 2 / 4 for a kernel compiled with 1), to see what cluster scheduling costs the stream
#   bash benchmarks/run_session27.sh h
case "$1" in
h)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "cluster4" 2>&1 | tee "$OUT/tests_${GPU}_session27$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_cluster": 4}' '{"gluon_cluster": 2}' \
      --out "$OUT/timeline_hist_${GPU}_session27$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 220 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_cluster": 4}' '{"gluon_cluster": 2}' '{}' '{"gluon_cluster": 4}' \
      --out "$OUT/profile_op_${GPU}_session27$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run h's result (H100): 25 GPU tests passed (the decode op's cluster4 variant). Clusters of 4 break the
# history's single wave: at B=1/128K its 1024 programs went to 124 SMs, up to 12 on one, the last entering at 29.3 us
# -- graph 57.9-59.8 us against 42.8-43.5; B=8/128K 295.9-297.0 against 249.5-249.9, B=32/32K 403.8-404.3 against
# 270.6. Clusters of 2 cost little (B=1/128K 43.2-43.3, B=8/128K 250.1, B=32/32K 272.1: within 0.6%). Removed (run h
# ran at 728cbae). Run g's JSON is its second run's (at 883c3aa: two exchanges timed); the first run (one exchange,
# 1.2 us) was at b0de60c.
# Run i: a deeper ring for the loop without more copies before the handoff -- 6 or 8 stages (gluon_stages_long), of
# whose first 5 / 7 copies only 3 go out before the wait (gluon_early_copies, run f's mechanism, back for this run),
# the rest behind the operands' loads; and 8 stages all early, as in session 25
#   bash benchmarks/run_session27.sh i
case "$1" in
i)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "deep8" 2>&1 | tee "$OUT/tests_${GPU}_session27$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 8, "gluon_early_copies": 3}' \
      '{"gluon_stages_long": 6, "gluon_early_copies": 3}' '{"gluon_stages_long": 8}' \
      --out "$OUT/timeline_hist_${GPU}_session27$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 220 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_stages_long": 8, "gluon_early_copies": 3}' \
      '{"gluon_stages_long": 6, "gluon_early_copies": 3}' '{"gluon_stages_long": 8}' '{}' \
      '{"gluon_stages_long": 8, "gluon_early_copies": 3}' \
      --out "$OUT/profile_op_${GPU}_session27$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run i's result (H100): 25 GPU tests passed (the decode op's deep8 variant). Deeper rings are slower: 6
# stages with 3 early copies B=1/128K 44.6-45.0 us, 8 stages with 3 early 48.0, 8 all early 45.2-45.6, against
# 42.8-44.0 (B=8/128K 253.0 / 256.8-257.3 / 254.6 against 248.6-249.3; B=32/32K 273.2 / 275.7-275.9 / 276.9 against
# 270.5-271.1). The loop itself gets shorter (ref_step -> loop_end p50 23.8 / 23.8 / 22.5 against 24.6 us), but with
# 8 stages the history's shared memory leaves room for fewer programs beside the prologue's (129 SMs used, entry p50
# 4.2-4.5 against 1.3 us) and the handoff's loads queue longer (waited -> ref_step p90 2.0-2.9 against 1.3 us).
# Removed (run i ran at 807e0d7).
# Run j (H200): the two probes on the other GPU
#   bash benchmarks/run_session27.sh j
case "$1" in
j)
  timeout 150 python3 "$R/scripts/probe_fixed_costs.py" --out "$OUT/probe_fixed_costs_${GPU}_session27$1.json" 2>&1 \
      | grep -E "^loads|^graph|^rotation"
  timeout 120 python3 "$R/scripts/probe_cluster.py" --out "$OUT/probe_cluster_${GPU}_session27$1.json" 2>&1 | tail -4
  ;;
esac
# (appended) run j's result (H200): the same as on the H100 but the exchange -- one round of a rotation program's
# loads 1.5 us after the clean flush (0.75 hot, no TLB part), entry -> product tf32x3 2.75 / FMAs 1.75 us, a graph of
# 1 / 2 / 3 trivial launches 4.0 / 5.8 / 7.5 us (5.7 / 6.9 under PDL); the cluster probe right eagerly, under PDL and
# from a graph, an exchange p50 0.61 us the first time and 0.51 the second (H100: 1.2 / 1.0).
# Run k (H100, at 1b63795, after the probes' review: the stamp from query_triton.stamp_asm, the 64 MB flush through
# bench_kernels.flush_l2(buf)): both probes again, as one device call --
#   source benchmarks/device_env.sh; python3 "$R/scripts/probe_fixed_costs.py" --iters 10 --out "$OUT/pf.json";
#   python3 "$R/scripts/probe_cluster.py" --out "$OUT/pc.json"
# (results/probe_fixed_costs_h100_session27k.json, probe_cluster_h100_session27k.json): the same numbers as runs a, b,
# g (loads 1.5 us cold / 0.75 hot, entry -> product tf32x3 2.75 / FMAs 1.75 us, exchange 1.2 / 1.0 us, all right);
# one trivial launch's graph 3.68 us here against 4.1-4.3 in runs a, b.
