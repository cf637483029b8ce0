#!/usr/bin/env bash
# Session-26 device runs, from the repository root, one `run` call each; results were copied from $OUT to
# benchmarks/results/ afterwards (GPU name in each file; "h100"/"h200" in the file names):
#   bash benchmarks/run_session26.sh a   # the history's work pool (CONFIG["gluon_pool"]: a share of each (row, head)'s
#                                        # history handed out in chunks by an atomic counter to the programs that end
#                                        # their split first): GPU tests, the B=1/128K timeline, the op's graph time
#                                        # at the benchmark's corners, paired with the defaults
# Runs a-g ran code that was measured and removed afterwards: run a at af76148, c at 4484a2f, e at be71f0d (the pool),
# g at 9af38b2 (the wait's prefetch); `git checkout <commit>` to run them again. Runs i, j: the final tree.
source benchmarks/device_env.sh
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o -E "H100|H200" | tr A-Z a-z)
case "$1" in
a|b)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "work_pool or (rotating and pool) or qflag_counters or timestamps" 2>&1 \
      | tee "$OUT/tests_${GPU}_session26$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_pool": 0.1}' '{"gluon_pool": 0.2}' '{"gluon_pool": 0.1, "gluon_pool_chunk": 1}' \
      --out "$OUT/timeline_hist_${GPU}_session26$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 220 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_pool": 0.1}' '{"gluon_pool": 0.2}' '{"gluon_pool": 0.1, "gluon_pool_chunk": 1}' \
      '{"gluon_pool": 0.05}' '{}' '{"gluon_pool": 0.1}' \
      --out "$OUT/profile_op_${GPU}_session26$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run a's result (H100): the pool balances the programs' ends (SMs' last exits p50 34.8, max 35.7 us against
# 34.2 / 35.7) but every program asked for its first ticket at its start, so the first 128 chunks of a head were handed
# out at once, not to the programs that end first, and those 1024 atomics shared a 128-byte line with the prologue ->
# history counters the history programs poll: their wait ended ~1 us later (p50 6.8 against 5.8 us). B=1/128K graph
# 43.0-44.8 (pool 0.05-0.2) against 42.7-43.5 us; B=8/128K 248.4-249.9 (but 256.7 with one-step chunks) against
# 252.0-252.2, B=32/32K 265.5-266.2 against 269.4-270.0. The GPU test's case had splits too short for the pool (it never
# engaged: 6 failed, as they should). Run c (H100): tickets asked for a chunk before a range ends, counters one line
# each, the GPU test at 30K
#   bash benchmarks/run_session26.sh c
case "$1" in
c|d)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "work_pool or (rotating and pool) or qflag_counters or timestamps" 2>&1 \
      | tee "$OUT/tests_${GPU}_session26$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_pool": 0.1}' '{"gluon_pool": 0.2}' '{"gluon_pool": 0.2, "gluon_pool_chunk": 1}' \
      --out "$OUT/timeline_hist_${GPU}_session26$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 220 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_pool": 0.1}' '{"gluon_pool": 0.2}' '{"gluon_pool": 0.2, "gluon_pool_chunk": 1}' \
      '{"gluon_pool": 0.3}' '{}' '{"gluon_pool": 0.2}' \
      --out "$OUT/profile_op_${GPU}_session26$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run c's result (H100): 17 GPU tests passed. The waits end as without the pool (p50 5.6 against 6.1 us) and
# the loop ends are even (p10 32.6, max 34.3 us with one-step chunks, against 30.2 / 34.9), but the loop is bound by the
# HBM: balanced, every program ends near the old last one. B=1/128K graph 42.5-43.3 (pool 0.1-0.3) against 42.6-43.4 us;
# B=8/128K 248.2-252.3 against 252.6; B=32/32K 266.6-267.7 (0.1, 0.2) against 269.2-270.2. Run e (H200): the pool's
# tests, its sweep, and the benchmark's B=1/128K and B=8/128K with the back-to-back graph timing (bench_kernels.py
# timed_seq) under the pool 0.1
#   bash benchmarks/run_session26.sh e
case "$1" in
e|f)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "work_pool or (rotating and pool)" 2>&1 | tee "$OUT/tests_${GPU}_session26$1.log" | tail -3
  timeout 200 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_pool": 0.1}' '{"gluon_pool": 0.2}' '{"gluon_pool": 0.2, "gluon_pool_chunk": 1}' \
      '{}' '{"gluon_pool": 0.1}' \
      --out "$OUT/profile_op_${GPU}_session26$1.json" 2>&1 | grep -E "^B="
  timeout 200 python3 "$R/scripts/bench_kernels.py" --batches 1,8 --lengths 131072 --no-write \
      --config '{"gluon_pool": 0.1}' --out "$OUT/kernels_${GPU}_session26$1.json" 2>&1 | grep -v -E "Warn|warn" | tail -4
  ;;
esac
# (appended) run e's result (H200): 15 GPU tests passed; the pool is slower on the H200, whose loop is issue-bound (its
# instructions: the loop's SASS with its branches 381 against 322): B=8/128K 201.1-203.8 against 196.2-196.3 us,
# B=32/32K 227.3-228.9 against 218.8-219.2 (218.4 with one-step chunks), B=1/128K 37.9-39.0 against 37.1-37.4; only
# B=8/8K gains (33.1-33.2 against 33.9-34.1). The pool stays off. The benchmark with the back-to-back timing (4 calls a
# graph, the pool on): B=1/128K 3.40x one call a graph, 3.60x back to back; B=8/128K 4.74x / 4.69x. Run g (H100): the L2
# prefetch in the history's wait for the rotation (CONFIG["gluon_wpf"]: after gluon_wpf_ns from its entry, a program
# prefetches its next steps into L2, so that the memory does not idle between its first copies' arrival and the loop's
# start)
#   bash benchmarks/run_session26.sh g
case "$1" in
g|h)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --rootdir "$R" "$R/tests/kernels/test_int2_attention.py" \
      -k "rotating and (wpf or pool)" 2>&1 | tee "$OUT/tests_${GPU}_session26$1.log" | tail -3
  timeout 150 python3 "$R/scripts/timeline_hist_programs.py" --points 1x131072 --iters 10 \
      --configs '{}' '{"gluon_wpf": 3}' '{"gluon_wpf": 6}' '{"gluon_wpf": 3, "gluon_wpf_ns": 1000}' \
      --out "$OUT/timeline_hist_${GPU}_session26$1.json" 2>&1 | grep -v -E "Warn|warn" \
      | grep -E "^B=|prologue|combine|at  |->"
  timeout 250 python3 "$R/scripts/profile_decode_op.py" --points 1x131072,1x32768,8x131072,8x8192,32x32768 --iters 10 \
      --configs '{}' '{"gluon_wpf": 3}' '{"gluon_wpf": 6}' '{"gluon_wpf": 3, "gluon_wpf_ns": 1000}' \
      '{"gluon_wpf": 3, "gluon_wpf_ns": 3000}' '{"gluon_wpf": 10}' '{}' '{"gluon_wpf": 6}' \
      --out "$OUT/profile_op_${GPU}_session26$1.json" 2>&1 | grep -E "^B="
  ;;
esac
# (appended) run g's result (H100): 18 GPU tests passed. The prefetch shortens the loop (ref_step -> loop_end p50 24.6
# -> 23.8 / 22.9 us with 3 / 6 steps) but the wait ends later (waited p50 5.8 -> 6.7 / 6.9 us: the handoff's release,
# poll and operand loads queue behind the prefetches, as behind more early copies in session 25), so the last loop end
# does not move (34.4 -> 34.8 / 34.8); B=1/128K graph 43.0-44.2 against 42.8-43.7 us, B=8 and B=32 within -1.2% / +0.4%
# (B=8/8K: 35.8-36.4 against 36.0-36.5). The pool (runs a, c, e) and the wait's prefetch are dropped, their code
# removed. Run i (H100) and j (H200): the benchmark of the defaults (unchanged since session 24) with the back-to-back
# graph timing (timed_seq)
#   bash benchmarks/run_session26.sh i
case "$1" in
i|j)
  timeout 480 python3 "$R/scripts/bench_kernels.py" --batches 1,8,32 --lengths 8192,32768,131072 \
      --out "$OUT/kernels_${GPU}_session26$1.json" 2>&1 | grep -v -E "Warn|return F" | tail -14
  ;;
esac
# (appended) runs i, j: the benchmark reproduces session 24's within noise (graph speedup at 128K, B = 1 / 8 / 32: H100
# 4.26x / 5.50x / 5.86x, H200 3.49x / 4.86x / 4.93x); back to back, 4 calls a graph: H100 4.35x / 5.52x (B=32/128K: not
# enough memory for 4 states), H200 3.68x / 4.82x / 4.99x. Nothing else changed in the kernels this session (the tree's
# kernels are session 25's, GPU-tested in its run u).
# Run k (H100): the benchmark's B=1/128K and B=8/128K again after timed_seq became a call of timed (the same graph of
# the 4 calls, the same 20 replays): the code the committed numbers describe runs as before
#   bash benchmarks/run_session26.sh k
case "$1" in
k|l)
  timeout 300 python3 "$R/scripts/bench_kernels.py" --batches 1,8 --lengths 131072 --no-write \
      --out "$OUT/kernels_${GPU}_session26$1.json" 2>&1 | grep -v -E "Warn|return F" | tail -4
  ;;
esac
# (appended) run k's result (H100): B=1/128K as in run i (one call a graph 43.4 us, back to back 41.6; 4.23x / 4.35x),
# but B=8/128K back to back 286.9 us against 250.4 in run i (one call a graph 251.0 in both). Run m (H100): how much
# the back-to-back timing moves from one measurement to the next: B=1 and B=8 at 128K, the one-call graph and the
# back-to-back graph timed alternately, three times each, on the same 4 states
#   bash benchmarks/run_session26.sh m
case "$1" in
m|n)
  timeout 300 python3 - "$R" "$OUT/seq_check_${GPU}_session26$1.json" <<'PY' 2>&1 | grep -v -E "Warn|warn"
import json, sys, torch
sys.path.insert(0, sys.argv[1] + "/scripts")
import bench_kernels as bk
bk.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
gen = torch.Generator().manual_seed(0)
res = {"device": torch.cuda.get_device_name(0), "rows": []}
for b in (1, 8):
    ops = [bk.oscar_op(bk.make_decode(b, 131072, gen)) for _ in range(bk.SEQ_CALLS)]
    for rep in range(3):
        one = bk.timed(ops[0], graph=True) * 1e3
        seq = bk.timed_seq(ops) * 1e3
        res["rows"].append({"B": b, "rep": rep, "graph_us": one, "graph_seq_us": seq})
        print(f"B={b} rep {rep}: one call a graph {one:.1f} us, back to back {seq:.1f} us", flush=True)
    del ops
    torch.cuda.empty_cache()
json.dump(res, open(sys.argv[2], "w"), indent=1)
PY
  ;;
esac
# (appended) run m's result (H100): steady -- B=1/128K one call a graph 42.8-43.1 us, back to back 41.4-41.6; B=8/128K
# 247.1-248.4 and 248.3-248.9. Run k's 286.9 us at B=8 was not seen again (one measurement, the first of the OSCAR
# timings after that point's SDPA runs).
