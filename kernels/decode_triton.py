"""Split-K decode attention over the packed INT2 history (Triton).

Two public entry points, each **two kernel launches** per call -- **three** where the history programs run on the
Gluon kernel of :mod:`kernels.decode_gluon` (CUDA, D = 128, G = 64, <= 8 query rows per KV head, bf16 metadata, no
key mask, at least ``CONFIG["gluon_min_work"]`` history token-heads): that kernel, then ``_split_kernel`` for the
window programs only (``PID_OFF``), then the combine kernel:

* :func:`history_partial_triton` -- the contract of
  :func:`oscar_hf.kernels.int2_attention.history_partial_reference`: online-softmax partials
  ``(m, l, acc)`` of the history in the rotated value space.
  Launch 1 ``_split_kernel``, grid ``(B * Hk, S)``: program ``(bh, s)`` streams history tokens
  ``[s * L, (s + 1) * L)`` of one KV head in blocks of ``BLOCK_N`` and keeps a running max / sum /
  accumulator for all ``M`` query rows of that head (GQA: ``M = group * q_len``, padded to
  ``M_PAD >= 16`` for ``tl.dot``). Launch 2 ``_combine_kernel``, grid ``(B * Hk * M,)``: one program
  per query row merges the ``S`` partials by log-sum-exp.
* :func:`decode_attention_triton` -- the whole decode attention op of one layer on top of it:
  INT2 history + a full-precision window (sink + recent, unrotated) -> normalized output in the
  original value space. Same two launches: the split kernel gets extra programs for the window
  (so the window runs concurrently with the history instead of after it); the combine kernel merges
  history and window partials, rotates the merged history row back (``acc R_Vᵀ + l mu_V``, a per-row
  mat-vec) and normalizes.
* :func:`decode_attention_rotating_triton` -- the same op from the *unrotated* query (what the dynamic cache's
  attention calls since session 14): the op launches the query rotation itself, on the Gluon path in one launch with
  the window programs (:func:`_prologue_kernel`), so that path makes three launches (rotation + window, Gluon history,
  combine), with programmatic dependent launch between them (``CONFIG["pdl"]`` 5: the history's first loads under the
  rotation, the combine's launch under the history's tail; ``CONFIG["gluon_qflag"]``: the history waits for counters
  the rotation programs raise, not for the rotation's grid).

Math of one history block (``n`` = token, ``c`` = channel, ``g(c)`` its group, ``p`` a plane):
byte ``j`` holds the codes of channels ``j + p * D/4`` in bits ``2p..2p+1``, so one shift and mask
of the ``[BLOCK_N, D/4]`` byte tile yields the codes of the contiguous channel block ``p``. Four
inner-loop variants (``CONFIG["loop"]``):

* deferred (default, ``G >= D/4``): the rowdot K logits, but no per-block reductions: each split
  exponentiates against one fixed reference (the max of its first block) and keeps ``l``, ``sum p z``
  and the running max as elementwise ``[BLOCK_N, M_PAD]`` tiles, reduced once after the loop; values
  as bf16 ``(p s)ᵀ . code/4`` (``p`` may exceed 1). A split whose true max strays more than
  ``DF_LIM`` from the reference is run again against its true max (see :func:`_split_kernel`).
  18% fewer SASS instructions per 64-token block than rowdot (681 vs 833, no shuffles; 21% fewer
  executed in the whole kernel, Nsight Compute) but no faster on the H200 at B=8 (Nsight Compute: both latency-bound, ~2 active warps per scheduler);
* rowdot (``G >= D/4``; measured on the H100): the K byte
  tile is the tensor cores' A operand in its natural ``[token, channel]`` layout (no transposition),
  logits are computed transposed (``[BLOCK_N, M_PAD]``, softmax over axis 0), codes enter as exact
  fp16 ``1024 + 4^p code`` (bit pattern ``0x6400 | (byte & 3 << 2p)``: one and-or per code, no shift,
  no int->float conversion), scale/zero are applied to the logits and to ``P`` (see the comment in
  :func:`_split_kernel` and :func:`_u_plane`, :func:`_rd_v_plane`);
* factored: codes as exact bf16 ``v = 1 + code/4``, K bytes loaded transposed, scale/zero applied to
  the ``[M, BLOCK_N]`` results (:func:`_k_plane`, :func:`_v_plane`);
* dequant (the first version; also the fallback when ``G < D/4``): keys are dequantized in registers
  plane by plane, ``k_hat = zero[n, g(c)] + code[n, c] * scale[n, g(c)]`` (bf16), and
  ``logits = sum_p q_p · k_hat_pᵀ`` accumulates over the four planes; the values likewise.

The deferred loop loads each block's scale/zero one iteration ahead (``CONFIG["meta_ahead"]``): those 2-byte
loads are synchronous, and carried in registers their latency overlaps a block's work (the code tiles' addresses
stay functions of the loop index, so that the software pipeliner still turns them into asynchronous copies). On
the GPU it extracts the codes in inline PTX (``CONFIG["asm_codes"]``, :func:`_u_plane_asm`, :func:`_v_code_asm`)
and runs under a register cap that fits 3 programs per SM (``CONFIG["maxnreg"]``). The split-K factor fills the
GPU's resident program slots in whole waves (:func:`num_splits`).

Both the deferred and rowdot loops can prefetch the codes and scale/zero of the block ``CONFIG["prefetch"]``
blocks ahead into L2 (inline PTX ``prefetch.global.L2``, :func:`_prefetch_block`). It took 15% off the H200 sweep
of session 6, when the metadata loads were what the kernel waited on; since session 9 (codes pipelined, 3
programs per SM) it only costs instructions and is off by default.

The full-precision history is never materialized: at most one ``BLOCK_N`` tile per program lives in
registers. Logits are computed in base 2: ``q`` and ``qk_offset`` are pre-scaled by
``scaling * log2(e)`` and ``exp2`` is used; ``m`` is returned in natural units (``m2 * ln 2``),
``l`` is the same in either base.

Masking: token ``n`` of row ``b`` is valid when ``start[b] <= n < N`` and ``key_mask[b, h, 0, n]``;
with ``n_valid`` (a device scalar, the static cache under CUDA graphs) ``N`` is the storage capacity
and ``n < n_valid`` is read by the kernel itself, so nothing on the host depends on the length;
the kernel takes ``key_mask`` None or broadcastable to ``[B, Hk, 1, N]`` (no per-query masks: the
dispatcher falls back to the reference for those). Blocks entirely below ``start[b]`` are skipped.
Value metadata of invalid tokens is never read (masked loads), so stale storage cannot poison
``acc`` with NaN.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from oscar_hf.quant import QuantizedRows

from . import cdiv, cuda_major, next_pow2
from .query_triton import (C_BLOCK as ROT_C_BLOCK, Q8_FIELDS, Q8_TILE_BYTES, _rotate_block, _rotate_plane_q8,
                           launch_rotation, rotation_strides, stamp_asm as _stamp_asm)


LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
_LN2 = tl.constexpr(LN2)  # jit code may only read constexpr globals
DF_LIM = tl.constexpr(64.0)  # deferred loop: largest excess of a row's max over its reference (log2 units)

# Tunables (read by the dispatch below; the benchmark may override them).
# Tile: the best of the sweep on an H100 (scripts/bench_kernels.py --sweep,
# benchmarks/results/kernels_h100.json: 64-token blocks, 4 warps, 4 stages) with the "deferred" loop,
# which with that config was as fast as "rowdot" or faster at every graph-timed H200 point from 32K on
# (B=1/128K 0.157 vs 0.201 ms) and within 3% below (benchmarks/results/kernels_h200.json).
CONFIG = {
    "block_n": 64,  # history tokens per inner-loop step
    "num_warps": 4,
    "num_stages": 4,
    # split-K factor S: None = the wave model of num_splits (programs resident per SM below); a number = the rule of
    # sessions 3-7, B * Hk * S ~ programs_per_sm * SMs (kept so that the recorded sweeps' commands still mean the same)
    "programs_per_sm": None,
    # programs of the split kernel one SM holds at once, which the wave model of num_splits fills. None: from the
    # register cap below (65536 // (maxnreg * 32 * num_warps): 3 at 168), else 2 (ptxas takes 238-255 registers
    # x 128 threads for the default tile: the sm_90 compile test and ncu)
    "resident_programs": None,
    "max_waves": 4,  # at most this many waves of programs (more splits: more partials to merge, more prologues)
    "min_split": 256,  # never fewer tokens than this per split
    "win_split": 128,  # window tokens per window program
    "loop": "deferred",  # inner loop of the history split: "deferred" | "rowdot" | "factored" | "dequant" (module doc)
    # deferred / rowdot loops: L2 prefetch of the codes and scale/zero this many blocks ahead (0: off). 4 was the
    # fastest of 0/1/2/4 on the H200 (benchmarks/results/kernels_h200_prefetch.json: geomean of B=1/128K,
    # B=8/128K, B=32/32K 0.616 -> 0.525 ms, -15%); the synchronous 2-byte metadata loads then hit L2.
    # Session 9: 0 is the default again. With the deferred loop's code tiles software-pipelined (asynchronous copies,
    # see meta_ahead) and 3 programs per SM the prefetch only cost instructions: split kernel B=8/128K 635 -> 608 us,
    # B=1/128K 87 -> 83 us, B=32/32K 631 -> 602 us (benchmarks/results/profile_op_h200_session9b.json).
    "prefetch": 0,
    # deferred loop, NG = 2 groups with bf16 scale/zero: one 4-byte load per token for both groups (_bf16_pair).
    # Default since session 9: with the code tiles pipelined again it gained at every point (H200 split kernel,
    # benchmarks/results/profile_op_h200_session9c.json: B=8/128K 559 -> 526 us, B=1/128K 78 -> 72, B=32/32K 559 -> 523)
    "pair_meta": True,
    # deferred loop: load each block's scale / zero one iteration ahead (registers), so that their latency overlaps a
    # block's work (ncu: the loop stalled on them, "long scoreboard"). H200, split kernel (session 8,
    # benchmarks/results/profile_op_h200_session8c.json): B=8/128K 939 -> 886 us, B=32/32K 711 -> 671, B=1/128K 103 -> 100
    "meta_ahead": True,
    # combine kernel: split partials merged per step (a power of two; more splits: online rescaling). 128: B=1/128K with
    # the Gluon history (208 partials per row) in two rounds instead of four, combine 12.5 -> 9.1 us (H200,
    # benchmarks/results/profile_op_h200_session11d.json)
    "merge_block": 128,
    # the same where the combine has fewer programs than SMs (8 warps each, B=1 at Hk=8: ~200 splits a row): all of a
    # row's splits in one round (H100, B=1/128K: combine 9.9 -> 8.6 us, op 65.5 -> 64.4; profile_op_h100_session14a.json)
    "merge_block_few": 256,
    # combine kernel (decode op), R_V in chunks: the window partials and R_V's first chunk loaded with the history
    # partials, each next chunk before the one before it is used (HOIST in _combine_kernel), where there are at most
    # merge_hoist_win window splits a row and D <= 128; with it R_V in 64-row chunks at D = 128 (merge_cblock None).
    # H200, combine / graph time of the op (benchmarks/results/profile_op_h200_session16i.json): B=8/128K 11.2 -> 7.0
    # us / 215.7 -> 212.1, B=8/8K 10.8 -> 6.0 / 46.7 -> 42.2, B=1/128K 8.2 -> 6.7 / 51.0 -> 51.1, B=32/32K 15.2 -> 15.2
    # / 229.1 -> 229.1 (32-row chunks: 7.4, 7.1, 7.8, 15.8 us)
    "merge_hoist": 1,
    "merge_hoist_win": 16,
    "merge_warps": None,  # combine kernel (decode op): warps per program (None: automatic, see _launch)
    "merge_cblock": None,  # combine kernel (decode op): output channels per un-rotation step (None: automatic)
    # smallest query-row tile (power of two). 8 halves the deferred loop's registers (238 -> 128, 4 programs per SM
    # instead of 2) but was 1.5x SLOWER on the H200 at B=8/128K (benchmarks/results/kernels_h200_mpad.json)
    "m_pad_min": 16,
    # ptxas register cap of the deferred loop's threads at its default tile (D = 128, <= 16 query rows, 4 warps; other
    # shapes and loops keep ptxas's choice). None: 255 registers, 2 programs per SM. 168 fits 3 programs of 4 warps in
    # an SM's 64K registers at the price of ~60 bytes of spills; 128 fits 4 but spills ~300 bytes. H200, split kernel
    # (benchmarks/results/profile_op_h200_session9b.json, prefetch 4): B=8/128K 659 -> 635 us, B=1/128K 94 -> 87 us,
    # B=32/32K 657 -> 631 us, B=8/8K 55 -> 50 us; with 128: 20% slower than 255 (profile_op_h200_session9a.json).
    "maxnreg": 168,
    # deferred loop on the GPU: the code extraction of K and V written in inline PTX (_u_plane_asm, _v_code_asm): one
    # prmt per two bytes shared by the four planes, then one lop3 per two codes. SASS per 64-token block (Triton 3.6,
    # the device's): 642 -> 547 instructions (scripts/sass_report.py deferred --asm 0|1); H200 split kernel
    # (profile_op_h200_session9c.json): B=8/128K 610 -> 559 us, B=1/128K 83 -> 78, B=32/32K 608 -> 559
    "asm_codes": 1,
    # the history splits of the common decode shape (D = 128, G = 64, <= 8 query rows per KV head, bf16 metadata, no
    # key mask) run on the Gluon kernel of kernels/decode_gluon.py (one warp per program, layouts stated, ~12 SASS
    # instructions per history token instead of ~32); the window programs and the combine stay here. 0: this file's
    # kernel for everything.
    "gluon": 1,
    # Gluon programs (one warp each) resident per SM, for the wave model of num_splits: under the 168-register cap
    # below, 65536 // (168 * 32) = 12
    "gluon_resident": 12,
    # the Gluon kernel's full steps through a cp.async shared-memory pipeline of 2 or 4 stages (0: loads to registers
    # with an L2 prefetch): B=8/128K history kernel 247 -> 219 us with 2 stages, 219 with 4 (H200, session 12 run c;
    # a skewed 4-stage loop, the next step's logits beside this step's values, 224 us: dropped)
    "gluon_stages": 2,
    # the same where a split is long (at least gluon_long_split tokens): 4 stages (3 steps of copies in flight) took the
    # H200 history kernel from 198.9 to 195.8 us at B=8/128K and 195.4 to 191.2 at B=32/32K (graph time of the op
    # 221.3 -> 217.9, 235.6 -> 231.7), but short splits pay for the longer pipeline start (B=8/8K op 46.2 -> 47.0 us)
    # (benchmarks/results/profile_op_h200_session16{c,d,e}.json); the H100 is indifferent (profile_op_h100_session16f)
    "gluon_stages_long": 4,
    "gluon_splitk": 1,  # one key accumulator per plane (shorter MMA chains)
    "gluon_maxnreg": 168,  # ptxas register cap of the Gluon kernel
    # where the splits are long (gluon_long_split: the int8 key path, 4 stages), 8 programs an SM (2 warps a scheduler)
    # under ptxas's own limit instead of 12 under 168 registers (which spill ~200 bytes): H200 graph time of the op
    # B=8/128K 212.3 -> 202.7 us, B=32/32K 228.7 -> 220.9, B=32/128K 741.7 -> 726.9; 11 and 10 programs an SM (184,
    # 200 registers) were slower than either (232.2, 220.0 against 210.5), and short splits lose (B=1/128K 50.9 -> 52.1,
    # B=8/8K 39.6 -> 40.6) so they keep the cap (benchmarks/results/profile_op_h200_session19{c,d}.json)
    "gluon_resident_long": 8,
    "gluon_maxnreg_long": 255,
    "gluon_l2pf": 1,  # Gluon kernel: L2 prefetch this many steps ahead (0: off)
    # the value codes' offset (256 per code) removed by one MMA against a ones tile per group and token tile, the
    # column sums subtracted after the loop, instead of a -256 MMA after every value MMA (36 MMAs a step, not 48;
    # costs 40 bytes of spill at TB = 2). H200 graph time of the op: B=8/128K 308.7 -> 303.4 us, B=32/32K 339.6 ->
    # 331.6, B=1/128K 63.7 -> 64.4 (benchmarks/results/profile_op_h200_session11b.json)
    "gluon_gsum": 1,
    "gluon_min_work": 500_000,  # history tokens x (row, KV head) pairs of a call from which the Gluon kernel serves
    # window tokens per window program when the history runs on the Gluon kernel and there are few programs (at most 8
    # per SM): the window programs are then a launch of their own, after the history, so their latency chain is on
    # the critical path (H200, B=1/128K: 9.7 -> 3.9 us; B=32/32K, 2560 programs of 32 tokens: 24.7 -> 31.7 us, so not
    # there; benchmarks/results/profile_op_h200_session11a.json). Up to 8 per SM since session 13 (B=8, 640 programs:
    # window kernel 9.8 -> 7.6 us, op 51.0 -> 48.8 us at 8K, 8.6 -> 6.7 us at 128K; profile_op_h200_session13e.json)
    # 64 since session 16 (B=8: 5 programs a row and head, not 10): H200 prologue B=8/128K 10.6 -> 9.7 us, op 212.1 ->
    # 210.8, B=8/8K 42.2 -> 40.1, B=1/128K 51.2 -> 51.2 (benchmarks/results/profile_op_h200_session16n.json)
    "gluon_win_split": 64,
    "gluon_win_stages": 2,  # software-pipeline stages of the window steps in a window-only launch
    # programmatic dependent launch of the Gluon path's launches (see _launch). Off: it took the op alone from 66.5 to
    # 63.7 us at B=1/128K and 311.2 to 308.7 at B=8/128K (H200, graph time, profile_op_h200_session11b.json), but made
    # the compiled StaticOscarCache decode step of a Qwen3-8B-shaped model at B=8 / 32K slower, 28.7 -> 30.1 ms per
    # token (generate_h200_b8_t32768_session11g*.json). 2 (the default since session 14): only between the rotation's
    # launch (with the window programs) and the history kernel, which issues its first loads before it waits
    # (gluon_early), and only where the op rotates the query itself (decode_attention_rotating_triton: the dynamic
    # cache; the static cache rotates outside its op). H200, graph time: B=1/128K 53.2 -> 52.3 us, B=8/128K 237.5 ->
    # 236.1, B=8/8K 47.9 -> 46.8 (profile_op_h200_session14b.json). 4: pdl 2 and the combine under PDL (see _launch):
    # +-1 us, mixed (profile_op_h200_session17{e,f}.json). 5 (the default since session 24): pdl 2 and the combine
    # under PDL, let go by each history program after its loop (not on entry as with 4, whose combine programs then
    # sit beside the whole history): H100 graph us B=1/128K 44.8-45.0 -> 44.3-44.6, B=8 and B=32 even
    # (profile_op_h100_session24e.json)
    "pdl": 5,
    # Gluon kernel: the split's first loads (the reference step's words, the first full steps' copies) issued before the
    # query's (pdl 2 needs them there: before its wait)
    "gluon_early": 1,
    # decode_attention_rotating_triton on the Gluon path: the query rotation and the window programs in one launch
    # (_prologue_kernel) instead of one launch each (0: the rotation kernel, then the window-only launch)
    "fused_prologue": 1,
    # Gluon kernel: the key logits on int8 tensor cores (mma m16n8k32): a plane of 4 key bytes is one int8 operand
    # register after one lop3 (fp16 operands: 2.5 instructions per register of 2 codes), the query as two int8 operands
    # (hi + lo / 254: 15 bits of each group's largest entry). 324 instead of 374 instructions per 32-token step
    # (sm_90 SASS, Triton 3.9), but a longer setup (the query's int8 split): H200 history kernel B=8/128K 217.4 ->
    # 201.1 us, B=32/32K 216.1 -> 195.9, but B=1/128K (21 steps a program) 36.5 -> 38.4, B=8/8K 22.8 -> 24.3
    # (profile_op_h200_session15b.json). 1: where a split is long (gluon_long_split); 2: always; 0: never
    "gluon_k8": 1,
    # history tokens of a split from which the Gluon kernel's long-split choices apply (int8 keys, gluon_stages_long,
    # gluon_resident_long). 2048 until session 19, tuned under the old "dirty" L2 flush (scripts/bench_kernels.py
    # FLUSH_MODE), which charged every timed call ~50 MB of write-back: under the clean flush the long-split path wins
    # on short splits too (H200 graph us, 2048 -> 256: B=1/128K 46.3 -> 43.1, B=8/8K 36.7 -> 35.1, B=8/32K 77.9 ->
    # 71.0, B=16/32K 144.3 -> 131.2, B=32/8K 92.0 -> 84.9, the rest unchanged; profile_op_h200_session20c.json). With
    # min_split 256 that is nearly every Gluon call
    "gluon_long_split": 256,
    # the decode op's combine: one warp per query row from this many rows per SM on (see _launch)
    "merge_one_warp_rows": 4,
    # the decode op's combine where it has fewer rows than SMs (B * Hk * M: B=1 at Hk=8, GQA 4): this many programs a
    # row, each un-rotating a slice of the output channels (1 / parts of R_V's rows; _combine_kernel PARTS), with
    # merge_warps_few warps each (None: 8), and the split-K factor rounded down to a power of two where that drops at
    # most splits_pow2_slack of the splits (_pow2_below_within), so that the combine's power-of-two tile of a row's
    # splits is full (132 splits a row at B=1/128K filled half of a 256-row tile). H200, session 21 (graph us of the
    # op, combine kernel us; profile_op_h200_session21{b,c}.json): B=1/128K 43.6 -> 40.6 (6.3 -> 3.7), B=1/32K 37.5 ->
    # 36.0 (5.4 -> 3.5), B=1/8K 24.9 -> 22.4 (5.4 -> 3.1); 4 parts alone 41.4 / 36.2 / 24.2; 8 parts 46.2 / 38.1 /
    # 24.8; 4 warps without the rounding 43.9 at B=1/128K (7.5 us: a 256-row tile in 4 warps). The rounding costs the
    # H200's history kernel ~0.7 us there (the H100's ends 3.2 us sooner: 42.5 -> 39.3 us in the timeline of
    # profile_op_h100_session21g), and 4 us at B=8/128K (where the combine is no matter): only where rows are few
    "merge_out_parts": 4,
    "merge_warps_few": 4,
    "splits_pow2_slack": 0.05,
    # the int8 key path's query operands (hi / lo planes, scales, sums) built once per (row, KV head) by the fused
    # prologue's rotation programs (one per plane of 32 channels; query_triton._rotate_plane_q8) and loaded by the
    # history programs, instead of built by each of them from q_rot (the B=1/128K programs spent 3.2 us on it after
    # their PDL wait, H100, session 22). 0: each history program builds them
    "gluon_qpre": 1,
    # warps of the fused prologue's programs (None: num_warps). 8 were slower (H100, session 23 run c: B=8/128K 254.3 ->
    # 255.2 us, B=32/32K 267.6 -> 274.8; its window programs)
    "prologue_warps": None,
    # with gluon_qpre and pdl >= 2: the history programs of a (row, KV head) wait for its 4 rotation programs' counter
    # (raised once their operands are stored; _ready_counters), not for the whole prologue grid's completion
    # (griddepcontrol.wait, released ~1.4 us after the last prologue program's exit). H100, session 24 (graph us,
    # with pdl 5): B=1/128K 44.4-44.7 -> 43.3-44.0, B=8/128K 253.3-254.2 -> 252.3-252.7 (profile_op_h100_session24g)
    "gluon_qflag": 1,
}


@triton.jit
def _op16(x, LOWP: tl.constexpr):
    """fp16 dot operand on the GPU, float32 under the interpreter (see :func:`_op`)."""
    if LOWP:
        return x.to(tl.float16)
    else:
        return x.to(tl.float32)


@triton.jit
def _u_plane(bytes_, P: tl.constexpr, LOWP: tl.constexpr, EXACT: tl.constexpr):
    """Codes of plane ``P`` of a byte tile as exact tensor-core operands, with no shift and no
    int->float conversion: ``byte & (3 << 2P)`` is ``4^P code``; or-ed into the fp16 bit pattern of
    1024 (``0x6400``, whose mantissa LSB is worth 1; ``4^P code <= 192`` fits the 10 mantissa bits)
    it reads as ``u = 1024 + 4^P code``: one and-or per code. ``EXACT`` subtracts the 1024 (exact in
    fp16), else the caller removes the offset from the result. Interpreter (float32): ``u = 1 + 4^P
    code`` (offset ``OFFS = 1``), so the offset bookkeeping is exercised on the CPU too."""
    m = bytes_ & (3 << (2 * P))
    if LOWP:
        u = (m.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)
        if EXACT:
            u = u - 1024.0
        return u
    else:
        u = m.to(tl.float32)
        if not EXACT:
            u = u + 1.0
        return u


# PTX of _u_plane_asm / _v_code_asm, one string per plane P (the mask 3 << 2P in both 16-bit halves). Key codes:
# fp16 1024 + 4^P code; value codes: bf16 256 + KP code, plane 3 shifted down by 2 first (its bits would reach the
# exponent). The leading cvt + prmt is the same for the four planes of a tile, so ptxas computes it once.
_K_PLANE_ASM = tl.constexpr(tuple(
    "{ .reg .b32 w; cvt.u32.u16 w, $1; prmt.b32 w, w, 0, 0x4140; "
    f"lop3.b32 $0, w, 0x{(3 << 2 * p) * 0x10001:08X}, 0x64006400, 0xEA; }}" for p in range(4)))
_V_PLANE_ASM = tl.constexpr(tuple(
    "{ .reg .b32 w; cvt.u32.u16 w, $1; prmt.b32 w, w, 0, 0x4140; " + ("shr.b32 w, w, 2; " if p == 3 else "")
    + f"lop3.b32 $0, w, 0x{(3 << 2 * min(p, 2)) * 0x10001:08X}, 0x43804380, 0xEA; }}" for p in range(4)))


@triton.jit
def _u_plane_asm(bytes_, P: tl.constexpr):
    """:func:`_u_plane` (not EXACT) in PTX, two codes at a time: ``prmt`` moves the two bytes into the low bytes of
    the two 16-bit halves (the same for the four planes of a byte tile: ptxas merges it), then one ``lop3`` keeps
    plane ``P``'s bits and or-s in 0x6400 (the fp16 bit pattern of 1024). Written out because the Triton versions
    differ in what they make of the same arithmetic (3.6: an and and an or per two codes; 3.9: the masks
    re-materialized in registers). GPU only."""
    return tl.inline_asm_elementwise(_K_PLANE_ASM[P], "=r,h", [bytes_], dtype=tl.float16, is_pure=True, pack=2)


@triton.jit
def _gsum(t, g: tl.constexpr, PPG: tl.constexpr):
    """Sum of the per-plane vectors ``t[P]`` of the planes of group ``g`` (planes ``g*PPG ..``)."""
    acc = t[g * PPG]
    for j in tl.static_range(1, PPG):
        acc += t[g * PPG + j]
    return acc


@triton.jit
def _op(x, LOWP: tl.constexpr):
    """Operand dtype of the attention dots: bf16 on the GPU (LOWP=1); float32 under the Triton
    interpreter (LOWP=0), whose ``tl.dot`` multiplies the raw uint16 bits of bf16 tensors."""
    if LOWP:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def _int2_plane(bytes_, P: tl.constexpr, s_tile, z_tile, s_row, z_row, nmask,
                D4: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, LOWP: tl.constexpr):
    """Dequantize plane ``P`` (channels ``[P*D4, (P+1)*D4)``) of a ``[BLOCK_N, D4]`` byte tile to the
    dot operand dtype: ``zero[n, g(c)] + code[n, c] * scale[n, g(c)]``."""
    code = ((bytes_ >> (2 * P)) & 3).to(tl.float32)
    if G >= D4:
        # The plane lies in one group g: pick column g of the [BLOCK_N, NG] metadata tiles (a
        # one-hot sum over NG <= 8 register values; the tiles were loaded once per block).
        onehot = tl.arange(0, NG)[None, :] == (P * D4) // G
        s = tl.sum(tl.where(onehot, s_tile, 0.0), 1)
        z = tl.sum(tl.where(onehot, z_tile, 0.0), 1)
        return _op(z[:, None] + code * s[:, None], LOWP)
    else:
        # D4 // G groups inside the plane (D=256, G=32): gather scale/zero per channel (L1 hits).
        g = (P * D4 + tl.arange(0, D4)) // G
        s = tl.load(s_row[:, None] + g[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        z = tl.load(z_row[:, None] + g[None, :], mask=nmask[:, None], other=0.0).to(tl.float32)
        return _op(z + code * s, LOWP)


@triton.jit
def _col(tile, g: tl.constexpr, NG: tl.constexpr):
    """Column ``g`` of a ``[BLOCK_N, NG]`` register tile (one-hot sum over NG <= 8 values)."""
    return tl.sum(tl.where(tl.arange(0, NG)[None, :] == g, tile, 0.0), 1)


@triton.jit
def _code_operand(bytes_, P: tl.constexpr, LOWP: tl.constexpr):
    """Codes of plane ``P`` as exact bf16 tensor-core operands ``v = 1 + code / 4``: the bf16 bit
    pattern ``0x3F80 | code << 5`` (1.0 with the code in the top two mantissa bits), i.e. one shift
    and one and-or per code, no int->float conversion. float32 under the interpreter (LOWP=0)."""
    b16 = bytes_.to(tl.uint16)
    if 2 * P >= 5:
        sh = b16 >> (2 * P - 5)
    else:
        sh = b16 << (5 - 2 * P)
    v = ((sh & 0x60) | 0x3F80).to(tl.bfloat16, bitcast=True)
    if LOWP:
        return v
    else:
        return v.to(tl.float32)


@triton.jit
def _k_plane(q_p, qs_p, kbT, P: tl.constexpr, s_tile, z_tile,
             D4: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, LOWP: tl.constexpr):
    """Logits of plane ``P`` (``[M_PAD, BLOCK_N]``) from the transposed byte tile ``kbT [D4, BLOCK_N]``:
    ``sum_c q[c] (z + s code[c]) = 4 s (q_p · v_p) + (z - 4 s) sum_c q[c]`` (the plane lies in group g)."""
    g: tl.constexpr = (P * D4) // G
    s = _col(s_tile, g, NG)
    z = _col(z_tile, g, NG)
    qv = tl.dot(q_p, _code_operand(kbT, P, LOWP))
    return (4.0 * s)[None, :] * qv + (z - 4.0 * s)[None, :] * qs_p[:, None]


@triton.jit
def _v_plane(p, alpha, vb, P: tl.constexpr, s_tile, z_tile, acc, zacc,
             D4: tl.constexpr, G: tl.constexpr, NG: tl.constexpr, LOWP: tl.constexpr):
    """``acc_p += sum_n p (z + s code) = W · v_p - sum_n W + sum_n p z`` with ``W = bf16(4 p s)``
    rounded once and used in both terms (so the offset cancels exactly); the two row sums go to
    ``zacc`` (added to every channel of the plane at the end)."""
    g: tl.constexpr = (P * D4) // G
    s = _col(s_tile, g, NG)
    z = _col(z_tile, g, NG)
    w = _op(p * (4.0 * s)[None, :], LOWP)
    acc = tl.dot(w, _code_operand(vb, P, LOWP), acc * alpha[:, None])
    zacc = zacc * alpha + tl.sum(p * z[None, :], 1) - tl.sum(w.to(tl.float32), 1)
    return acc, zacc


@triton.jit
def _rd_v_plane(p, alpha, vb, P: tl.constexpr, vs_base, vz_base, meta, valid, acc, zacc,
                D4: tl.constexpr, G: tl.constexpr, LOWP: tl.constexpr):
    """Row-dot values of plane ``P`` (group ``g``): ``acc += W_g . (4^P code_P)`` with
    ``W_g = (p s_g)ᵀ`` ([M_PAD, BLOCK_N], fp16), ``zacc += sum_n p z_g``; both rescaled by ``alpha``.
    Planes of one group compute the same ``W_g`` / ``zacc`` terms (merged by the compiler's CSE)."""
    g: tl.constexpr = (P * D4) // G
    s = tl.load(vs_base + meta + g, mask=valid, other=0.0).to(tl.float32)
    z = tl.load(vz_base + meta + g, mask=valid, other=0.0).to(tl.float32)
    w = _op16(tl.trans(p * s[:, None]), LOWP)
    acc = tl.dot(w, _u_plane(vb, P, LOWP, True), acc * alpha[:, None])
    zacc = zacc * alpha + tl.sum(p * z[:, None], 0)
    return acc, zacc


@triton.jit
def _bf16_pair(base, meta, mask):
    """Scale (or zero) of groups 0 and 1 of each token (NG = 2, bf16 metadata) with ONE 4-byte load per
    token instead of two 2-byte ones, widened to float32 by a 16-bit shift (little endian: group 0 in the
    low half). Halves the synchronous metadata loads the split kernel waits on."""
    w = tl.load((base + meta).to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    return (w << 16).to(tl.float32, bitcast=True), (w & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _meta_groups(base, meta, mask, NG: tl.constexpr):
    """Scale (or zero) of every group of a block's tokens, as a tuple of ``NG <= 4`` float32 vectors."""
    g0 = tl.load(base + meta, mask=mask, other=0.0).to(tl.float32)
    if NG == 1:
        return (g0,)
    elif NG == 2:
        return (g0, tl.load(base + meta + 1, mask=mask, other=0.0).to(tl.float32))
    else:
        return (g0, tl.load(base + meta + 1, mask=mask, other=0.0).to(tl.float32),
                tl.load(base + meta + 2, mask=mask, other=0.0).to(tl.float32),
                tl.load(base + meta + 3, mask=mask, other=0.0).to(tl.float32))


@triton.jit
def _df_meta(ks_base, kz_base, vs_base, vz_base, offs_n, inb, valid, NG: tl.constexpr, PAIR: tl.constexpr):
    """The deferred loop's metadata of one block: K scale / zero (in-bounds tokens) and V scale / zero (valid
    tokens only: stale storage may hold NaN), each a tuple over the groups (:func:`_bf16_pair` when ``PAIR``)."""
    meta = offs_n.to(tl.int64) * NG
    if PAIR:
        return (_bf16_pair(ks_base, meta, inb), _bf16_pair(kz_base, meta, inb),
                _bf16_pair(vs_base, meta, valid), _bf16_pair(vz_base, meta, valid))
    else:
        return (_meta_groups(ks_base, meta, inb, NG), _meta_groups(kz_base, meta, inb, NG),
                _meta_groups(vs_base, meta, valid, NG), _meta_groups(vz_base, meta, valid, NG))


@triton.jit
def _rd_logits(kb, qts, cps, qss, ks_base, kz_base, meta, inb, off, PPG: tl.constexpr,
               BLOCK_N: tl.constexpr, M_PAD: tl.constexpr, LOWP: tl.constexpr, PRE: tl.constexpr = 0,
               s_pre=None, z_pre=None, ASM: tl.constexpr = 0):
    """Row-dot logits ``[BLOCK_N, M_PAD]`` (log2 units, offset ``q·mu_K`` included) of one K byte tile
    ``kb [BLOCK_N, D/4]``: four plane dots with the tile as the A operand; after the last plane of a
    group, its scale / zero are applied (see the rowdot comment in :func:`_split_kernel`). ``PRE``:
    scale / zero come preloaded (``s_pre``, ``z_pre``: one vector per group, :func:`_df_meta`)."""
    st = tl.zeros((BLOCK_N, M_PAD), tl.float32) + off[None, :]
    d = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    for P in tl.static_range(4):
        if ASM:
            d = tl.dot(_u_plane_asm(kb, P), qts[P], d)
        else:
            d = tl.dot(_u_plane(kb, P, LOWP, False), qts[P], d)
        if P % PPG == PPG - 1:  # last plane of group g: apply its scale / zero
            if PRE:
                sg = s_pre[P // PPG]
                zg = z_pre[P // PPG]
            else:
                sg = tl.load(ks_base + meta + P // PPG, mask=inb, other=0.0).to(tl.float32)
                zg = tl.load(kz_base + meta + P // PPG, mask=inb, other=0.0).to(tl.float32)
            # s (d - C) + z Qs as three fused multiply-adds into st (d - C first took a separate add and multiply;
            # the rounding of s d + st is of the order of the tensor cores' own fp32 accumulation error in d)
            st = tl.fma(sg[:, None], d, st)
            st = tl.fma(-sg[:, None], _gsum(cps, P // PPG, PPG)[None, :], st)
            st = tl.fma(zg[:, None], _gsum(qss, P // PPG, PPG)[None, :], st)
            d = tl.zeros((BLOCK_N, M_PAD), tl.float32)
    return st


@triton.jit
def _v_code_operand(vb, P: tl.constexpr, LOWP: tl.constexpr):
    """Codes of plane ``P`` of a value byte tile as exact bf16 ``KP * code`` with ``KP = 2 * 4^min(P, 2)``, no
    per-code shift for planes 0-2: ``byte & (3 << 2P)`` (``4^P code <= 48``) or-ed into the bit pattern of 256.0
    (``0x4380``, mantissa LSB worth 2) reads as ``256 + KP code``, and the subtraction of 256 is exact (one
    and-or + one packed subtract per two codes, against two shifts, a byte merge, an and-or and a subtract
    for ``_code_operand``); plane 3's bits 6-7 would reach the exponent, so it is shifted down to bits 4-5 first.
    Float32 under the interpreter (the same bit pattern, widened)."""
    if P < 3:
        m = vb & (3 << (2 * P))
    else:
        m = (vb >> 2) & 0x30
    u = (m.to(tl.uint16) | 0x4380).to(tl.bfloat16, bitcast=True)
    if LOWP:
        return u - 256.0
    else:
        return u.to(tl.float32) - 256.0


@triton.jit
def _v_code_asm(vb, P: tl.constexpr):
    """:func:`_v_code_operand` on the GPU in PTX, two codes at a time: ``prmt`` moves the two bytes into the low
    bytes of the two 16-bit halves (shared by the four planes), one ``lop3`` keeps plane ``P``'s bits and or-s in
    the bit pattern of 256.0 (plane 3: shifted down by 2 first, its bits 6-7 would reach the exponent). Same values
    as :func:`_v_code_operand`: ``256 + KP code``; the caller's subtraction of 256 is exact."""
    u = tl.inline_asm_elementwise(_V_PLANE_ASM[P], "=r,h", [vb], dtype=tl.bfloat16, is_pure=True, pack=2)
    return u - 256.0


@triton.jit
def _df_v_plane(p, vb, P: tl.constexpr, vs_base, vz_base, meta, valid, acc, zt,
                D4: tl.constexpr, G: tl.constexpr, PPG: tl.constexpr, LOWP: tl.constexpr, PRE: tl.constexpr = 0,
                s_pre=None, z_pre=None, ASM: tl.constexpr = 0):
    """Deferred-loop values of plane ``P`` (group ``g``): ``acc += bf16((p s_g)ᵀ) . (KP code_P)`` -- bf16,
    since ``p`` is relative to a fixed reference and may exceed 1; ``KP`` (:func:`_v_code_operand`) is divided
    out after the loop -- and the elementwise tile ``zt += p z_g`` (reduced over tokens once, after the loop;
    kept by the group's first plane only). No rescaling: the reference is fixed. Planes of one group compute
    the same ``W_g`` (merged by CSE: one transposition through shared memory per group)."""
    g: tl.constexpr = (P * D4) // G
    if PRE:  # preloaded (:func:`_df_meta`)
        s = s_pre[g]
        z = z_pre[g]
    else:
        s = tl.load(vs_base + meta + g, mask=valid, other=0.0).to(tl.float32)
        z = tl.load(vz_base + meta + g, mask=valid, other=0.0).to(tl.float32)
    w = _op(tl.trans(p * s[:, None]), LOWP)
    if ASM:
        acc = tl.dot(w, _v_code_asm(vb, P), acc)
    else:
        acc = tl.dot(w, _v_code_operand(vb, P, LOWP).to(w.dtype), acc)
    if P % PPG == 0:
        zt += p * z[:, None]
    return acc, zt


@triton.jit
def _meta_tiles(s_base, z_base, offs_n, nmask, NG: tl.constexpr):
    """``[BLOCK_N, NG]`` scale/zero tiles (float32) of a block: rows are contiguous (``NG``
    values per token), so this is one vectorized, pipelinable load per tensor; plus the row pointers."""
    offs = offs_n.to(tl.int64)[:, None] * NG + tl.arange(0, NG)[None, :]
    s_tile = tl.load(s_base + offs, mask=nmask[:, None], other=0.0).to(tl.float32)
    z_tile = tl.load(z_base + offs, mask=nmask[:, None], other=0.0).to(tl.float32)
    row = offs_n.to(tl.int64) * NG
    return s_tile, z_tile, s_base + row, z_base + row


@triton.jit
def _prefetch_l2(ptrs, mask):
    """``prefetch.global.L2`` of each address (where ``mask``): the split kernel is latency-bound on its
    synchronous 2-byte scale/zero loads (benchmarks/results/ncu_split_h200.txt), which then hit L2 instead of
    HBM. GPU only (inline PTX); the result is a dummy kept alive by ``is_pure=False``."""
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1,
    )


@triton.jit
def _prefetch_block(n0, hi, kc_base, vc_base, ks_base, kz_base, vs_base, vz_base, skn, svn,
                    NG: tl.constexpr, BLOCK_N: tl.constexpr):
    """L2 prefetch of history block ``[n0, n0 + BLOCK_N)``: each token's code row (``D/4 <= 128`` bytes,
    one line or two) and its scale / zero entries."""
    offs = n0 + tl.arange(0, BLOCK_N)
    pm = offs < hi
    o64 = offs.to(tl.int64)
    _prefetch_l2(kc_base + o64 * skn, pm)
    _prefetch_l2(vc_base + o64 * svn, pm)
    _prefetch_l2(ks_base + o64 * NG, pm)
    _prefetch_l2(kz_base + o64 * NG, pm)
    _prefetch_l2(vs_base + o64 * NG, pm)
    _prefetch_l2(vz_base + o64 * NG, pm)


@triton.jit
def _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
    """History tokens ``[n0, n0 + BLOCK_N)`` of one (row, KV head): their indices, which are in
    bounds (``< hi``), and which are valid (in bounds, ``>= start`` of the row, and not masked)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    inb = offs_n < hi
    valid = inb & (offs_n >= start)
    if HAS_MASK:
        km = tl.load(KMASK + b.to(tl.int64) * smb + h * smh + offs_n * smn, mask=inb, other=0)
        valid = valid & (km != 0)
    return offs_n, inb, valid


@triton.jit
def _softmax_step(s, valid, m_i, l_i):
    """Online-softmax update in base 2 for a ``[M_PAD, BLOCK_N]`` logit tile. Fully masked rows keep
    ``m = -inf`` and contribute nothing (``m_safe`` avoids ``-inf - -inf``)."""
    s = tl.where(valid[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_i


@triton.jit
def _window_split(QW, KW, VW, WMASK, PM, PL, PACC, b, h, part, w0, W, win_split, qk_scale,
                  sqwb, sqwh, sqwm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
                  M, D: tl.constexpr, M_PAD: tl.constexpr, HAS_WMASK: tl.constexpr, LOWP: tl.constexpr,
                  PDL: tl.constexpr, WIN_STAGES: tl.constexpr):
    """One window program of :func:`_split_kernel`: full-precision (unrotated) window tokens ``[w0, w0 + win_split)``
    of one (row, KV head), online softmax over ``BLOCK_W``-token steps, partial ``(m, l, acc)`` at ``part``."""
    BLOCK_W: tl.constexpr = 32  # window tokens per step
    offs_m = tl.arange(0, M_PAD)
    offs_d = tl.arange(0, D)
    mrow = offs_m < M
    m_i = tl.full((M_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_PAD,), tl.float32)
    if PDL:  # the combine may launch (it waits for this grid's completion before reading partials)
        gdc_launch_dependents()
    qw = tl.load(QW + b.to(tl.int64) * sqwb + h * sqwh + offs_m[:, None] * sqwm + offs_d[None, :],
                 mask=mrow[:, None], other=0.0).to(tl.float32)
    qw = _op(qw * qk_scale, LOWP)
    acc = tl.zeros((M_PAD, D), tl.float32)
    w1 = tl.minimum(w0 + win_split, W)
    # Small tiles, and not software-pipelined (WIN_STAGES = 1) when the history programs share the launch:
    # keeps the shared memory of this branch below the history branch's, so occupancy is set by the history
    # programs. A window-only launch (the Gluon path) pipelines its steps.
    for n0 in tl.range(w0, w1, BLOCK_W, num_stages=WIN_STAGES):
        offs_n = n0 + tl.arange(0, BLOCK_W)
        valid = offs_n < w1
        if HAS_WMASK:
            wm = tl.load(WMASK + b.to(tl.int64) * swb + h * swh + offs_n * swn, mask=valid, other=0)
            valid = valid & (wm != 0)
        # keys and values loaded together: one round of memory latency per step, not two
        kw = tl.load(KW + b.to(tl.int64) * skwb + h * skwh + offs_n[:, None] * skwn + offs_d[None, :],
                     mask=valid[:, None], other=0.0)
        vw = tl.load(VW + b.to(tl.int64) * svwb + h * svwh + offs_n[:, None] * svwn + offs_d[None, :],
                     mask=valid[:, None], other=0.0)
        s = tl.dot(qw, tl.trans(_op(kw, LOWP)))
        p, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i)
        acc = tl.dot(_op(p, LOWP), _op(vw, LOWP), acc * alpha[:, None])
    tl.store(PACC + (part + offs_m[:, None]) * D + offs_d[None, :], acc, mask=mrow[:, None])
    tl.store(PM + part + offs_m, m_i, mask=mrow)
    tl.store(PL + part + offs_m, l_i, mask=mrow)
    if PDL:
        # launched while the Gluon history kernel runs (it reads nothing that kernel writes), this grid must
        # not complete before it: the combine's wait covers the grid just before it only
        gdc_wait()


@triton.jit
def _split_kernel(
    Q, KC, KS, KZ, VC, VS, VZ, START, KMASK, QKOFF, NPTR,  # history inputs (NPTR: device history length or None)
    QW, KW, VW, WMASK,  # full-precision window (decode_attention only)
    PM, PL, PACC,  # partials [B*Hk, S_TOT, M], [B*Hk, S_TOT, M], [B*Hk, S_TOT, M, D]
    N, M, Hk, S, S_TOT, split_len, W, win_split, qk_scale, PID_OFF,
    sqb, sqh, sqm,  # q_rot strides (last dim contiguous)
    skb, skh, skn, smkb, smkh,  # K codes [.., N, D/4] / K metadata [.., N, NG] strides (rows contiguous)
    svb, svh, svn, smvb, smvh,  # V likewise
    smb, smh, smn,  # key_mask strides
    sob, soh, som,  # qk_offset strides
    sqwb, sqwh, sqwm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,  # window strides
    D: tl.constexpr, G: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_OFF: tl.constexpr,
    HAS_WIN: tl.constexpr, HAS_WMASK: tl.constexpr, LOWP: tl.constexpr, LOOP: tl.constexpr,
    N_DEV: tl.constexpr, PREFETCH: tl.constexpr = 0, PAIR: tl.constexpr = 0, AHEAD: tl.constexpr = 0,
    ASM: tl.constexpr = 0, PDL: tl.constexpr = 0, WIN_STAGES: tl.constexpr = 1, WIN_ONLY: tl.constexpr = 0,
):
    D4: tl.constexpr = D // 4
    NG: tl.constexpr = D // G
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1) + PID_OFF  # > 0: only the window programs are launched (the history ran on Gluon)
    b = pid_bh // Hk
    h = pid_bh % Hk
    offs_m = tl.arange(0, M_PAD)
    offs_j = tl.arange(0, D4)
    offs_d = tl.arange(0, D)
    mrow = offs_m < M
    m_i = tl.full((M_PAD,), float("-inf"), tl.float32)
    l_i = tl.zeros((M_PAD,), tl.float32)
    part = (pid_bh.to(tl.int64) * S_TOT + pid_s) * M  # first partial row of this program

    if WIN_ONLY:  # the window programs of the Gluon path: this launch compiles without the history branch
        _window_split(QW, KW, VW, WMASK, PM, PL, PACC, b, h, part, (pid_s - S) * win_split, W, win_split,
                      qk_scale, sqwb, sqwh, sqwm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
                      M, D, M_PAD, HAS_WMASK, LOWP, PDL, WIN_STAGES)
    else:
        if pid_s < S:
            # ---------------- INT2 history split ----------------
            # q planes, pre-scaled so that logits come out in log2 units.
            q_ptr = Q + b.to(tl.int64) * sqb + h * sqh + offs_m[:, None] * sqm + offs_j[None, :]
            q0 = _op(tl.load(q_ptr + 0 * D4, mask=mrow[:, None], other=0.0) * qk_scale, LOWP)
            q1 = _op(tl.load(q_ptr + 1 * D4, mask=mrow[:, None], other=0.0) * qk_scale, LOWP)
            q2 = _op(tl.load(q_ptr + 2 * D4, mask=mrow[:, None], other=0.0) * qk_scale, LOWP)
            q3 = _op(tl.load(q_ptr + 3 * D4, mask=mrow[:, None], other=0.0) * qk_scale, LOWP)
            if HAS_OFF:
                off = tl.load(QKOFF + b.to(tl.int64) * sob + h * soh + offs_m * som, mask=mrow, other=0.0) * qk_scale
            else:
                off = tl.zeros((M_PAD,), tl.float32)
            acc0 = tl.zeros((M_PAD, D4), tl.float32)
            acc1 = tl.zeros((M_PAD, D4), tl.float32)
            acc2 = tl.zeros((M_PAD, D4), tl.float32)
            acc3 = tl.zeros((M_PAD, D4), tl.float32)
            zacc0 = tl.zeros((M_PAD,), tl.float32)  # sum_n p z of the value groups (rowdot / factored loops)
            zacc1 = tl.zeros((M_PAD,), tl.float32)
            zacc2 = tl.zeros((M_PAD,), tl.float32)
            zacc3 = tl.zeros((M_PAD,), tl.float32)

            start = tl.load(START + b).to(tl.int32)
            if N_DEV:
                # Static cache (CUDA graphs): N is the storage capacity, the valid length is read from
                # device memory and the S splits share it (the grid cannot change between replays).
                n_tot = tl.minimum(tl.load(NPTR).to(tl.int32), N)
                slen = tl.cdiv(tl.cdiv(tl.maximum(n_tot, 1), S), BLOCK_N) * BLOCK_N
            else:
                n_tot = N
                slen = split_len
            hi = tl.minimum(pid_s * slen + slen, n_tot)
            lo = tl.maximum(pid_s * slen, (start // BLOCK_N) * BLOCK_N)  # skip all-padding blocks
            kc_base = KC + b.to(tl.int64) * skb + h * skh
            ks_base = KS + b.to(tl.int64) * smkb + h * smkh
            kz_base = KZ + b.to(tl.int64) * smkb + h * smkh
            vc_base = VC + b.to(tl.int64) * svb + h * svh
            vs_base = VS + b.to(tl.int64) * smvb + h * smvh
            vz_base = VZ + b.to(tl.int64) * smvb + h * smvh
            if LOOP >= 2:
                # The row-dot K operands, shared by the rowdot and deferred loops (see the rowdot comment).
                PPG: tl.constexpr = G // D4  # planes per group
                OFFS = 1.0 + 1023.0 * LOWP  # the code offset of _u_plane (1024 on the GPU)
                qf0 = tl.load(q_ptr + 0 * D4, mask=mrow[:, None], other=0.0) * qk_scale
                qf1 = tl.load(q_ptr + 1 * D4, mask=mrow[:, None], other=0.0) * qk_scale
                qf2 = tl.load(q_ptr + 2 * D4, mask=mrow[:, None], other=0.0) * qk_scale
                qf3 = tl.load(q_ptr + 3 * D4, mask=mrow[:, None], other=0.0) * qk_scale
                # B operands [D4, M_PAD]: q_P / 4^P (exact power-of-two scaling before the fp16 rounding)
                qts = (_op16(tl.trans(qf0), LOWP), _op16(tl.trans(qf1 * 0.25), LOWP),
                       _op16(tl.trans(qf2 * 0.0625), LOWP), _op16(tl.trans(qf3 * 0.015625), LOWP))
                cps = (OFFS * tl.sum(qts[0].to(tl.float32), 0), OFFS * tl.sum(qts[1].to(tl.float32), 0),
                       OFFS * tl.sum(qts[2].to(tl.float32), 0), OFFS * tl.sum(qts[3].to(tl.float32), 0))
                qss = (tl.sum(qf0, 1), tl.sum(qf1, 1), tl.sum(qf2, 1), tl.sum(qf3, 1))
            if LOOP == 2:
                # Row-dot form (each plane inside one group, G >= D/4): the K byte tile is the A operand
                # of the tensor cores in its natural [token, channel] layout (no transposition), logits
                # are computed transposed, [BLOCK_N, M_PAD], and scale/zero are applied to them:
                #   logit[n, m] = sum_g s[n, g] * (sum_{P in g} u_P[n] . q_P[m] / 4^P - C_g[m]) + z[n, g] * Qs_g[m]
                # with u_P = OFFS + 4^P code (see _u_plane), C_g[m] = OFFS sum_{P in g} sum_c q_P[m, c] / 4^P
                # (the offset, from the same rounded operands the dot sees) and Qs_g[m] = sum_{c in g} q[m, c].
                # Values: acc_P[m, :] += W_g[m, :] . (4^P code_P) with W_g[m, n] = p[n, m] s[n, g] (the only
                # per-token-and-row multiply), zacc_g[m] += sum_n p[n, m] z[n, g]; at the end
                # acc_P / 4^P + zacc_g(P). Per code: one and-or (K), one and-or and one exact fp16 subtract (V).
                for n0 in range(lo, hi, BLOCK_N):
                    if PREFETCH > 0:
                        _prefetch_block(n0 + PREFETCH * BLOCK_N, hi, kc_base, vc_base, ks_base, kz_base, vs_base, vz_base,
                                        skn, svn, NG, BLOCK_N)
                    offs_n, inb, valid = _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                    meta = offs_n.to(tl.int64) * NG  # first metadata entry of each token
                    kb = tl.load(kc_base + offs_n[:, None].to(tl.int64) * skn + offs_j[None, :], mask=inb[:, None], other=0)
                    st = _rd_logits(kb, qts, cps, qss, ks_base, kz_base, meta, inb, off, PPG, BLOCK_N, M_PAD, LOWP)
                    # online softmax over the token axis (0) of the transposed tile
                    st = tl.where(valid[:, None], st, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(st, 0))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    alpha = tl.exp2(m_i - m_safe)
                    p = tl.exp2(st - m_safe[None, :])
                    l_i = l_i * alpha + tl.sum(p, 0)
                    m_i = m_new
                    # V: only valid tokens are read (p = 0 and s = z = 0 elsewhere)
                    vb = tl.load(vc_base + offs_n[:, None].to(tl.int64) * svn + offs_j[None, :], mask=valid[:, None], other=0)
                    acc0, zacc0 = _rd_v_plane(p, alpha, vb, 0, vs_base, vz_base, meta, valid, acc0, zacc0, D4, G, LOWP)
                    acc1, zacc1 = _rd_v_plane(p, alpha, vb, 1, vs_base, vz_base, meta, valid, acc1, zacc1, D4, G, LOWP)
                    acc2, zacc2 = _rd_v_plane(p, alpha, vb, 2, vs_base, vz_base, meta, valid, acc2, zacc2, D4, G, LOWP)
                    acc3, zacc3 = _rd_v_plane(p, alpha, vb, 3, vs_base, vz_base, meta, valid, acc3, zacc3, D4, G, LOWP)
                acc0 = acc0 + zacc0[:, None]
                acc1 = acc1 * 0.25 + zacc1[:, None]
                acc2 = acc2 * 0.0625 + zacc2[:, None]
                acc3 = acc3 * 0.015625 + zacc3[:, None]
            elif LOOP == 3:
                # Deferred form: the rowdot K logits, but no per-block reductions. Every block is
                # exponentiated against one fixed reference phi[m] (the max of the split's first block),
                # and l, sum p z and the running max are kept as elementwise [BLOCK_N, M_PAD] tiles
                # (registers only: no shuffles, no barriers, no rescaling of acc), reduced once after the
                # loop, where acc, l, zacc are rescaled to the true max. Guard: if any row's true max
                # differs from phi by more than DF_LIM (log2 units: p up to 2^DF_LIM stays far from
                # float32 / bf16 overflow; phi = 0 when the first block has no valid token could also
                # underflow every p) the split is run again with phi = its true max (at most once).
                # phi: max of the first block's valid logits (0 for rows without any there)
                offs_n, inb, valid = _token_block(lo, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                kb = tl.load(kc_base + offs_n[:, None].to(tl.int64) * skn + offs_j[None, :], mask=inb[:, None], other=0)
                st = _rd_logits(kb, qts, cps, qss, ks_base, kz_base, offs_n.to(tl.int64) * NG, inb, off,
                                PPG, BLOCK_N, M_PAD, LOWP)
                phi = tl.max(tl.where(valid[:, None], st, float("-inf")), 0)
                phi = tl.where(phi == float("-inf"), 0.0, phi)
                # the tiles carried out of the rerun loop must exist before it (they are reset per pass)
                lt = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                mt = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
                zt0 = tl.zeros((BLOCK_N, M_PAD), tl.float32)  # sum p z per group: tile of the group's first plane
                zt1 = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                zt2 = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                zt3 = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                run = 1
                while run > 0:
                    lt = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                    mt = tl.full((BLOCK_N, M_PAD), float("-inf"), tl.float32)
                    zt0 = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                    zt1 = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                    zt2 = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                    zt3 = tl.zeros((BLOCK_N, M_PAD), tl.float32)
                    acc0 = tl.zeros((M_PAD, D4), tl.float32)
                    acc1 = tl.zeros((M_PAD, D4), tl.float32)
                    acc2 = tl.zeros((M_PAD, D4), tl.float32)
                    acc3 = tl.zeros((M_PAD, D4), tl.float32)
                    off_phi = off - phi
                    if AHEAD:  # metadata of the first block, loaded before the loop (see META_AHEAD below)
                        offs_a, inb_a, valid_a = _token_block(lo, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                        md_a = _df_meta(ks_base, kz_base, vs_base, vz_base, offs_a, inb_a, valid_a, NG, PAIR)
                    for n0 in range(lo, hi, BLOCK_N):
                        if PREFETCH > 0:
                            _prefetch_block(n0 + PREFETCH * BLOCK_N, hi, kc_base, vc_base, ks_base, kz_base, vs_base,
                                            vz_base, skn, svn, NG, BLOCK_N)
                        if AHEAD:
                            # The scale / zero loads are synchronous 2-byte loads (the pipeliner cannot make them
                            # asynchronous copies) and the loop stalled on them (ncu: long scoreboard): issue the next
                            # block's here, one iteration before their use, and use the ones issued last iteration.
                            # Only the metadata is carried: the token indices and masks are recomputed from n0, since
                            # code loads whose addresses depend on a loop-carried value are not software-pipelined by
                            # Triton 3.6 (no asynchronous copies at all: the loop waited on its own global loads).
                            ksp, kzp, vsp, vzp = md_a
                            offs_n, inb, valid = _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                            offs_a, inb_a, valid_a = _token_block(n0 + BLOCK_N, hi, start, KMASK, b, h, smb, smh, smn,
                                                                  BLOCK_N, HAS_MASK)
                            md_a = _df_meta(ks_base, kz_base, vs_base, vz_base, offs_a, inb_a, valid_a, NG, PAIR)
                        else:
                            offs_n, inb, valid = _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                            if PAIR:  # NG = 2, bf16: one 4-byte load per token and tensor for both groups
                                ksp, kzp, vsp, vzp = _df_meta(ks_base, kz_base, vs_base, vz_base, offs_n, inb, valid, NG, 1)
                            else:
                                ksp = (off, off)  # unused
                                kzp = ksp
                                vsp = ksp
                                vzp = ksp
                        meta = offs_n.to(tl.int64) * NG
                        kb = tl.load(kc_base + offs_n[:, None].to(tl.int64) * skn + offs_j[None, :], mask=inb[:, None], other=0)
                        # logits relative to the reference (off_phi = off - phi: one subtraction per row, not per logit)
                        st = _rd_logits(kb, qts, cps, qss, ks_base, kz_base, meta, inb, off_phi, PPG, BLOCK_N, M_PAD, LOWP,
                                        PAIR or AHEAD, ksp, kzp, ASM and LOWP)
                        st = tl.where(valid[:, None], st, float("-inf"))
                        mt = tl.maximum(mt, st)
                        p = tl.exp2(st)
                        lt += p
                        vb = tl.load(vc_base + offs_n[:, None].to(tl.int64) * svn + offs_j[None, :], mask=valid[:, None], other=0)
                        acc0, zt0 = _df_v_plane(p, vb, 0, vs_base, vz_base, meta, valid, acc0, zt0, D4, G, PPG, LOWP,
                                                PAIR or AHEAD, vsp, vzp, ASM and LOWP)
                        acc1, zt1 = _df_v_plane(p, vb, 1, vs_base, vz_base, meta, valid, acc1, zt1, D4, G, PPG, LOWP,
                                                PAIR or AHEAD, vsp, vzp, ASM and LOWP)
                        acc2, zt2 = _df_v_plane(p, vb, 2, vs_base, vz_base, meta, valid, acc2, zt2, D4, G, PPG, LOWP,
                                                PAIR or AHEAD, vsp, vzp, ASM and LOWP)
                        acc3, zt3 = _df_v_plane(p, vb, 3, vs_base, vz_base, meta, valid, acc3, zt3, D4, G, PPG, LOWP,
                                                PAIR or AHEAD, vsp, vzp, ASM and LOWP)
                    m_i = tl.max(mt, 0) + phi  # (-inf stays -inf)
                    over = tl.where(m_i == float("-inf"), 0.0, m_i - phi)
                    run = 0
                    if tl.max(tl.where(mrow, tl.abs(over), 0.0), 0) > DF_LIM:
                        phi = tl.where(m_i == float("-inf"), phi, m_i)
                        run = 1
                # rescale from phi to the true max (rows without valid tokens: l = 0, m = -inf)
                m_safe = tl.where(m_i == float("-inf"), phi, m_i)
                alpha = tl.exp2(phi - m_safe)
                l_i = tl.sum(lt, 0) * alpha
                zs = (tl.sum(zt0, 0), tl.sum(zt1, 0), tl.sum(zt2, 0), tl.sum(zt3, 0))
                acc0 = (acc0 * 0.5 + zs[0][:, None]) * alpha[:, None]  # / KP of _v_code_operand: 2, 8, 32, 32
                acc1 = (acc1 * 0.125 + zs[1 - 1 % PPG][:, None]) * alpha[:, None]
                acc2 = (acc2 * 0.03125 + zs[2 - 2 % PPG][:, None]) * alpha[:, None]
                acc3 = (acc3 * 0.03125 + zs[3 - 3 % PPG][:, None]) * alpha[:, None]
            elif LOOP == 1:
                # Factored form (each plane inside one group): codes go to the tensor cores as exact
                # bf16 v = 1 + code/4, scale/zero are applied to the [M_PAD, BLOCK_N] results, see
                # _k_plane / _v_plane. Per code: a shift and an and-or (K and V alike).
                qs0 = tl.sum(q0.to(tl.float32), 1)
                qs1 = tl.sum(q1.to(tl.float32), 1)
                qs2 = tl.sum(q2.to(tl.float32), 1)
                qs3 = tl.sum(q3.to(tl.float32), 1)
                for n0 in range(lo, hi, BLOCK_N):
                    offs_n, inb, valid = _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                    # K bytes loaded transposed, [D4, BLOCK_N]: the tensor cores' B operand as is.
                    kbT = tl.load(kc_base + offs_n[None, :].to(tl.int64) * skn + offs_j[:, None], mask=inb[None, :], other=0)
                    ks_t, kz_t, ks_row, kz_row = _meta_tiles(ks_base, kz_base, offs_n, inb, NG)
                    s = _k_plane(q0, qs0, kbT, 0, ks_t, kz_t, D4, G, NG, LOWP)
                    s += _k_plane(q1, qs1, kbT, 1, ks_t, kz_t, D4, G, NG, LOWP)
                    s += _k_plane(q2, qs2, kbT, 2, ks_t, kz_t, D4, G, NG, LOWP)
                    s += _k_plane(q3, qs3, kbT, 3, ks_t, kz_t, D4, G, NG, LOWP)
                    p, alpha, m_i, l_i = _softmax_step(s + off[:, None], valid, m_i, l_i)
                    vb = tl.load(vc_base + offs_n[:, None].to(tl.int64) * svn + offs_j[None, :], mask=valid[:, None], other=0)
                    vs_t, vz_t, vs_row, vz_row = _meta_tiles(vs_base, vz_base, offs_n, valid, NG)
                    acc0, zacc0 = _v_plane(p, alpha, vb, 0, vs_t, vz_t, acc0, zacc0, D4, G, NG, LOWP)
                    acc1, zacc1 = _v_plane(p, alpha, vb, 1, vs_t, vz_t, acc1, zacc1, D4, G, NG, LOWP)
                    acc2, zacc2 = _v_plane(p, alpha, vb, 2, vs_t, vz_t, acc2, zacc2, D4, G, NG, LOWP)
                    acc3, zacc3 = _v_plane(p, alpha, vb, 3, vs_t, vz_t, acc3, zacc3, D4, G, NG, LOWP)
                acc0 += zacc0[:, None]
                acc1 += zacc1[:, None]
                acc2 += zacc2[:, None]
                acc3 += zacc3[:, None]
            else:
                for n0 in range(lo, hi, BLOCK_N):
                    offs_n, inb, valid = _token_block(n0, hi, start, KMASK, b, h, smb, smh, smn, BLOCK_N, HAS_MASK)
                    # K: unpack + dequantize 4 planes, logits = sum_p q_p k_p^T (one accumulator).
                    kb = tl.load(kc_base + offs_n[:, None].to(tl.int64) * skn + offs_j[None, :], mask=inb[:, None], other=0)
                    ks_t, kz_t, ks_row, kz_row = _meta_tiles(ks_base, kz_base, offs_n, inb, NG)
                    s = tl.dot(q0, tl.trans(_int2_plane(kb, 0, ks_t, kz_t, ks_row, kz_row, inb, D4, G, NG, LOWP)))
                    s = tl.dot(q1, tl.trans(_int2_plane(kb, 1, ks_t, kz_t, ks_row, kz_row, inb, D4, G, NG, LOWP)), s)
                    s = tl.dot(q2, tl.trans(_int2_plane(kb, 2, ks_t, kz_t, ks_row, kz_row, inb, D4, G, NG, LOWP)), s)
                    s = tl.dot(q3, tl.trans(_int2_plane(kb, 3, ks_t, kz_t, ks_row, kz_row, inb, D4, G, NG, LOWP)), s)
                    p, alpha, m_i, l_i = _softmax_step(s + off[:, None], valid, m_i, l_i)
                    p = _op(p, LOWP)
                    # V: only valid tokens are read, invalid ones dequantize to exactly 0.
                    vb = tl.load(vc_base + offs_n[:, None].to(tl.int64) * svn + offs_j[None, :], mask=valid[:, None], other=0)
                    vs_t, vz_t, vs_row, vz_row = _meta_tiles(vs_base, vz_base, offs_n, valid, NG)
                    acc0 = tl.dot(p, _int2_plane(vb, 0, vs_t, vz_t, vs_row, vz_row, valid, D4, G, NG, LOWP), acc0 * alpha[:, None])
                    acc1 = tl.dot(p, _int2_plane(vb, 1, vs_t, vz_t, vs_row, vz_row, valid, D4, G, NG, LOWP), acc1 * alpha[:, None])
                    acc2 = tl.dot(p, _int2_plane(vb, 2, vs_t, vz_t, vs_row, vz_row, valid, D4, G, NG, LOWP), acc2 * alpha[:, None])
                    acc3 = tl.dot(p, _int2_plane(vb, 3, vs_t, vz_t, vs_row, vz_row, valid, D4, G, NG, LOWP), acc3 * alpha[:, None])

            a_ptr = PACC + (part + offs_m[:, None]) * D + offs_j[None, :]
            tl.store(a_ptr + 0 * D4, acc0, mask=mrow[:, None])
            tl.store(a_ptr + 1 * D4, acc1, mask=mrow[:, None])
            tl.store(a_ptr + 2 * D4, acc2, mask=mrow[:, None])
            tl.store(a_ptr + 3 * D4, acc3, mask=mrow[:, None])
            tl.store(PM + part + offs_m, m_i, mask=mrow)
            tl.store(PL + part + offs_m, l_i, mask=mrow)
        else:
            if HAS_WIN:
                _window_split(QW, KW, VW, WMASK, PM, PL, PACC, b, h, part, (pid_s - S) * win_split, W, win_split,
                              qk_scale, sqwb, sqwh, sqwm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
                              M, D, M_PAD, HAS_WMASK, LOWP, PDL, WIN_STAGES)


@triton.jit
def _prologue_kernel(
    Q, RK, MU, QR, QO,  # rotation: q [B, Hk, M, D] (also the window's query), R_K, mu_K -> q_rot, q . mu_K
    KW, VW, WMASK, PM, PL, PACC,  # window keys / values / mask -> its partials (slots S .. S_TOT - 1)
    M, Hk, S, S_TOT, W, win_split, qk_scale,
    sqb, sqh, sqm, smb, smh,
    skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
    D: tl.constexpr, M_PAD: tl.constexpr, M_PAD_ROT: tl.constexpr, C_BLOCK: tl.constexpr, HAS_MU: tl.constexpr,
    HAS_WMASK: tl.constexpr, LOWP: tl.constexpr, WIN_STAGES: tl.constexpr, PDL: tl.constexpr = 0,
    TIMES=None, TIMED: tl.constexpr = 0, TIME_SLOTS: tl.constexpr = 8,
    QP8=None, QPF=None, QPRE: tl.constexpr = 0, TB: tl.constexpr = 2, READY=None, QFLAG: tl.constexpr = 0,
):
    """The Gluon path's first launch: the query rotation and the window programs side by side, since neither reads
    what the other writes (grid ``(B * Hk, D / C_BLOCK + S_TOT - S)``: programs ``j < D / C_BLOCK`` rotate column
    block ``j`` of the query, the rest are window programs ``j - D / C_BLOCK``). Before, each was a launch of its own,
    before and after the history kernel. ``QPRE`` (``C_BLOCK`` = 32, one plane): each rotation program also
    writes its plane's int8 query operands of the Gluon kernel's int8 key path (``query_triton._rotate_plane_q8``).

    ``QFLAG`` (with ``QPRE``): each rotation program adds 1 to ``READY[b * Hk + h]`` (release, GPU scope) once its
    plane's operands are stored; the history programs of that (row, head) wait for 4 there, not for this grid's
    completion (the combine sets it back to 0)."""
    pid_bh = tl.program_id(0)
    j = tl.program_id(1)
    NROT: tl.constexpr = D // C_BLOCK
    if PDL:  # the history kernel may launch now: it loads its first steps, then waits for the query (or QFLAG)
        gdc_launch_dependents()
    if TIMED:  # diagnostic (decode_gluon.TIMES_BUF): this program's entry and exit, its kind (0 rotation, 1 window)
        trow = TIMES + (PROLOGUE_TIME_ROW + pid_bh * tl.num_programs(1) + j) * TIME_SLOTS
        tl.store(trow, _stamp_asm(j))
        tl.store(trow + 3, (j >= NROT).to(tl.int64))
    if j < NROT:
        if QPRE:  # (C_BLOCK = 32: plane j)
            if TIMED:
                _rotate_plane_q8(Q, RK, MU, QR, QO, QP8, QPF, pid_bh, j, M, Hk, qk_scale, sqb, sqh, sqm, smb, smh,
                                 D, M_PAD_ROT, TB, HAS_MU, LOWP, trow, 1)
            else:
                _rotate_plane_q8(Q, RK, MU, QR, QO, QP8, QPF, pid_bh, j, M, Hk, qk_scale, sqb, sqh, sqm, smb, smh,
                                 D, M_PAD_ROT, TB, HAS_MU, LOWP)
            if QFLAG:  # every thread's stores before the release (the barrier), then one atomic for the program
                tl.debug_barrier()
                tl.atomic_add(READY + pid_bh, 1, sem="release", scope="gpu")
        else:
            _rotate_block(Q, RK, MU, QR, QO, pid_bh, j * C_BLOCK, M, Hk, sqb, sqh, sqm, smb, smh,
                          D, M_PAD_ROT, C_BLOCK, HAS_MU)
    else:
        b = pid_bh // Hk
        h = pid_bh % Hk
        part = (pid_bh.to(tl.int64) * S_TOT + S + (j - NROT)) * M
        _window_split(Q, KW, VW, WMASK, PM, PL, PACC, b, h, part, (j - NROT) * win_split, W, win_split, qk_scale,
                      sqb, sqh, sqm, skwb, skwh, skwn, svwb, svwh, svwn, swb, swh, swn,
                      M, D, M_PAD, HAS_WMASK, LOWP, 0, WIN_STAGES)
    if TIMED:
        tl.store(trow + 4, _stamp_asm(j))
        tl.store(trow + 7, tl.inline_asm_elementwise("mov.u32 $0, %smid; // $1", "=r,r", [j], dtype=tl.int32,
                                                     is_pure=False, pack=1).to(tl.int64))


PROLOGUE_TIME_ROW = tl.constexpr(60000)  # the prologue's rows of the diagnostic timestamp buffer
COMBINE_TIME_ROW = tl.constexpr(63000)  # the combine's (its hoisted variant only)


def _check_times_buf(buf, slots: int, hist_programs: int, prologue_programs: int, combine_programs: int = 0):
    """The diagnostic timestamp buffer (``decode_gluon.TIMES_BUF``, ``[rows, slots]``) must hold the history's programs
    below ``PROLOGUE_TIME_ROW``, the prologue's from there on up to ``COMBINE_TIME_ROW`` and the combine's from there
    on: a clear error, not stamps written past its end or over each other."""
    row0, row1 = PROLOGUE_TIME_ROW.value, COMBINE_TIME_ROW.value
    rows = row1 + combine_programs if combine_programs else row0 + prologue_programs  # the buffer's rows needed
    if (buf.dim() != 2 or buf.shape[1] != slots or hist_programs > row0 or row0 + prologue_programs > row1
            or buf.shape[0] < rows):
        raise ValueError(f"decode_gluon.TIMES_BUF: shape {tuple(buf.shape)} for {hist_programs} history programs (at "
                         f"most {row0}), {prologue_programs} prologue programs from row {row0} (at most {row1 - row0}) "
                         f"and {combine_programs} combine programs from row {row1}: needs [>= {rows}, {slots}]")
    if buf.dtype != torch.int64 or not buf.is_cuda or not buf.is_contiguous():
        raise ValueError("decode_gluon.TIMES_BUF must be a contiguous int64 CUDA tensor")


@triton.jit
def _history_window_weights(m_h, l_h, m_w, l_w):
    """The decode op's final merge of the history's ``(m_h, l_h)`` and the window's ``(m_w, l_w)`` (log2 units):
    ``(m_safe, w_h, w_w, w_h l_h, 1 / l_tot)`` with ``w = exp2(m_part - m)``, ``m_safe`` = the joint max (0 when both
    are -inf) and ``1 / l_tot`` 0 for a row without any valid key."""
    m = tl.maximum(m_h, m_w)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w_h = tl.exp2(m_h - m_safe)
    w_w = tl.exp2(m_w - m_safe)
    lh = w_h * l_h
    l_tot = lh + l_w * w_w
    return m_safe, w_h, w_w, lh, tl.where(l_tot > 0, 1.0 / tl.where(l_tot > 0, l_tot, 1.0), 0.0)


@triton.jit
def _combine_kernel(
    PM, PL, PACC, OM, OL, OACC, RV, MUV, M, Hk, S_HIST, S_TOT,
    D: tl.constexpr, S_BLOCK: tl.constexpr, C_BLOCK: tl.constexpr, FINAL: tl.constexpr, HAS_MUV: tl.constexpr,
    PDL: tl.constexpr = 0, HOIST: tl.constexpr = 0, SW_BLOCK: tl.constexpr = 1, PARTS: tl.constexpr = 1,
    READY=None, RESET: tl.constexpr = 0,
    TIMES=None, TIMED: tl.constexpr = 0, TIME_SLOTS: tl.constexpr = 8,
):
    """One program per (b, h, query row): log-sum-exp merge of the split partials.

    Splits ``[0, S_HIST)`` are history (rotated value space), ``[S_HIST, S_TOT)`` window (value space).
    Not FINAL (history_partial): write ``m`` (natural units), ``l``, ``acc``.
    FINAL (decode_attention): ``out = (w_h (acc_h R_Vᵀ + l_h mu_V) + w_w acc_w) / (w_h l_h + w_w l_w)``,
    where ``w = exp(m_part - m)``; the un-rotation is a per-row mat-vec over ``C_BLOCK`` output channels
    at a time, so only the merged history row (not each split) is rotated back. Rows without any
    valid key are 0.

    Latency, not bandwidth, sets this kernel's time (a few programs per SM, each a chain of dependent
    loads; 10 us of a 46 us B=1 op before session 7): the history is merged in ONE pass with a running
    max (one round of loads when ``S_HIST <= S_BLOCK``), and with ``C_BLOCK == D`` the whole ``R_V[h]``
    is loaded first, so its latency overlaps the partials' loads.

    ``HOIST`` (FINAL, ``C_BLOCK < D``, at most ``SW_BLOCK`` window splits): one round of loads before the merge -- the
    history partials, all window partials (``[SW_BLOCK, D]``) and ``R_V``'s first chunk -- and each further chunk's
    load issued before the chunk before it is used, instead of a round for the window's max, then per chunk one for
    ``R_V`` and the window's rows.

    ``PARTS`` (FINAL, ``C_BLOCK <= D / PARTS``): ``PARTS`` programs per row, each merging the row's partials and
    writing output channels ``[pc D / PARTS, (pc + 1) D / PARTS)`` only, so that each loads ``1 / PARTS`` of ``R_V[h]``
    (the partials are read ``PARTS`` times, from L2): more programs and fewer bytes each where there are few rows.

    ``RESET``: one program per (b, h) sets ``READY[b * Hk + h]`` (the prologue -> history counter of ``QFLAG``) back to
    0 for the next call (this call's history grid, and with it the prologue's, is complete by then).

    ``TIMED`` (FINAL, ``HOIST``; a diagnostic, ``decode_gluon.TIMES_BUF``): %globaltimer at the entry (slot 0), after the
    PDL wait (1) and at the exit (4), in the rows from ``COMBINE_TIME_ROW``."""
    row = tl.program_id(0) // PARTS  # = bh * M + mm
    c_lo = (tl.program_id(0) % PARTS) * (D // PARTS)  # this program's first output channel
    bh = row // M
    mm = row % M
    h = bh % Hk
    offs_s = tl.arange(0, S_BLOCK)
    offs_d = tl.arange(0, D)
    base = bh.to(tl.int64) * S_TOT * M + mm  # partial (bh, s, mm) lives at base + s * M
    if FINAL and C_BLOCK == D:
        r_all = tl.load(RV + h * D * D + offs_d[:, None] * D + offs_d[None, :])  # issued before the partials
    if FINAL and HOIST:  # R_V's first chunk of this program's channels
        r_next = tl.load(RV + h * D * D + (c_lo + tl.arange(0, C_BLOCK))[:, None] * D + offs_d[None, :])
    if TIMED:
        trow = TIMES + (COMBINE_TIME_ROW + tl.program_id(0)) * TIME_SLOTS
        tl.store(trow, _stamp_asm(bh))
    if PDL:  # programmatic dependent launch: the partials are ready once the grid before this one completed
        gdc_wait()
    if TIMED:
        tl.store(trow + 1, _stamp_asm(bh))
    if RESET:
        if tl.program_id(0) % (M * PARTS) == 0:  # (query row 0, part 0 of each (b, h))
            tl.store(READY + bh, 0)
    if FINAL and HOIST:  # the window partials [SW_BLOCK] / [SW_BLOCK, D], loaded with the history's
        offs_w = S_HIST + tl.arange(0, SW_BLOCK)
        wm = offs_w < S_TOT
        pm_w = tl.load(PM + base + offs_w * M, mask=wm, other=float("-inf"))
        pl_w = tl.load(PL + base + offs_w * M, mask=wm, other=0.0)
        a_w = tl.load(PACC + (base + offs_w[:, None] * M) * D + offs_d[None, :], mask=wm[:, None], other=0.0)
    # history splits: online log-sum-exp (log2 units), blocks of S_BLOCK splits
    m_h = tl.max(tl.full((S_BLOCK,), float("-inf"), tl.float32), 0)
    l_h = tl.sum(tl.zeros((S_BLOCK,), tl.float32), 0)
    acc = tl.zeros((D,), tl.float32)
    for s0 in range(0, S_HIST, S_BLOCK):
        sm = s0 + offs_s < S_HIST
        pm = tl.load(PM + base + (s0 + offs_s) * M, mask=sm, other=float("-inf"))
        pl = tl.load(PL + base + (s0 + offs_s) * M, mask=sm, other=0.0)
        a = tl.load(PACC + (base + (s0 + offs_s)[:, None] * M) * D + offs_d[None, :], mask=sm[:, None], other=0.0)
        m_new = tl.maximum(m_h, tl.max(pm, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_h - m_safe)  # 0 while m_h = -inf (empty splits so far)
        w = tl.exp2(pm - m_safe)
        l_h = l_h * alpha + tl.sum(w * pl, 0)
        acc = acc * alpha + tl.sum(w[:, None] * a, 0)
        m_h = m_new
    if FINAL and HOIST:
        # window (value space): its max, sum and weighted row [D] from the hoisted partials
        m_w = tl.max(pm_w, 0)
        w_w = tl.exp2(pm_w - tl.where(m_w == float("-inf"), 0.0, m_w))
        l_w = tl.sum(w_w * pl_w, 0)
        o_w = tl.reshape(tl.sum(w_w[:, None] * a_w, 0), (D // C_BLOCK, C_BLOCK))  # [chunk, C_BLOCK]
        m_safe, w_h, ww, lh, inv = _history_window_weights(m_h, l_h, m_w, l_w)
        acc = acc * w_h
        for ci in tl.static_range(D // C_BLOCK // PARTS):
            offs_c = c_lo + ci * C_BLOCK + tl.arange(0, C_BLOCK)
            r = r_next
            if ci + 1 < D // C_BLOCK // PARTS:  # the next chunk's load in flight while this one is used
                r_next = tl.load(RV + h * D * D + (offs_c + C_BLOCK)[:, None] * D + offs_d[None, :])
            o = tl.sum(r * acc[None, :], 1)
            if HAS_MUV:
                o += lh * tl.load(MUV + h * D + offs_c)
            # this chunk of the window's row (a masked sum over the chunk axis: no slicing of register tensors)
            o += ww * tl.sum(tl.where(tl.arange(0, D // C_BLOCK)[:, None] == c_lo // C_BLOCK + ci, o_w, 0.0), 0)
            tl.store(OACC + row.to(tl.int64) * D + offs_c, (o * inv).to(OACC.dtype.element_ty))
        if TIMED:
            tl.store(trow + 4, _stamp_asm(tl.max(o, 0).to(tl.int32, bitcast=True)))
    elif FINAL:
        # window splits (value space): their max and sum in one online pass; their acc rows per output chunk below
        m_w = tl.max(tl.full((S_BLOCK,), float("-inf"), tl.float32), 0)
        l_w = tl.sum(tl.zeros((S_BLOCK,), tl.float32), 0)
        for s0 in range(S_HIST, S_TOT, S_BLOCK):
            sm = s0 + offs_s < S_TOT
            pm = tl.load(PM + base + (s0 + offs_s) * M, mask=sm, other=float("-inf"))
            m_new = tl.maximum(m_w, tl.max(pm, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_w = l_w * tl.exp2(m_w - m_safe) + tl.sum(tl.exp2(pm - m_safe) * tl.load(PL + base + (s0 + offs_s) * M,
                                                                                   mask=sm, other=0.0), 0)
            m_w = m_new
        m_safe, w_h, ww, lh, inv = _history_window_weights(m_h, l_h, m_w, l_w)
        acc = acc * w_h
        for c0 in tl.static_range(0, D // PARTS, C_BLOCK):
            offs_c = c_lo + c0 + tl.arange(0, C_BLOCK)
            # history: (acc R_Vᵀ)[c] = sum_d R_V[c, d] acc[d], plus l_h * mu_V[c]
            if C_BLOCK == D:
                r = r_all
            else:
                r = tl.load(RV + h * D * D + offs_c[:, None] * D + offs_d[None, :])
            o = tl.sum(r * acc[None, :], 1)
            if HAS_MUV:
                o += lh * tl.load(MUV + h * D + offs_c)
            # window splits: already in the value space
            for s0 in range(S_HIST, S_TOT, S_BLOCK):
                sm = s0 + offs_s < S_TOT
                w = tl.exp2(tl.load(PM + base + (s0 + offs_s) * M, mask=sm, other=float("-inf")) - m_safe)
                a = tl.load(PACC + (base + (s0 + offs_s)[:, None] * M) * D + offs_c[None, :], mask=sm[:, None], other=0.0)
                o += tl.sum(w[:, None] * a, 0)
            tl.store(OACC + row.to(tl.int64) * D + offs_c, (o * inv).to(OACC.dtype.element_ty))
    else:
        tl.store(OM + row, m_h * _LN2)
        tl.store(OL + row, l_h)
        tl.store(OACC + row.to(tl.int64) * D + offs_d, acc)


# ----------------------------------------------------------------------------------------------
# host side


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_sms(device: torch.device) -> int:
    """SMs of a CUDA device (its index, or the current one); 4 elsewhere (the interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def resident_programs(cfg) -> int:
    """Split-kernel programs one SM holds at once (see CONFIG["resident_programs"])."""
    if cfg.get("resident_programs"):
        return cfg["resident_programs"]
    if cfg.get("maxnreg"):
        return max(1, 65536 // (cfg["maxnreg"] * 32 * cfg["num_warps"]))
    return 2


def num_splits(n: int, bh: int, device: torch.device, cfg=None, static: bool = False) -> int:
    """Split-K factor ``S`` for ``bh`` (row, KV head) pairs of ``n`` history tokens.

    The wave model (default): the GPU runs ``slots = resident_programs x SMs`` programs at once, so ``bh * S``
    programs take ``ceil(bh * S / slots)`` waves, each as long as one split, ``ceil(n / S)`` tokens (plus half a
    block for the deferred loop's reference prologue). Take the ``S`` of least ``waves x blocks per split`` (the
    smallest on ties: fewer partials to merge), at least ``min_split`` tokens per split, at most ``max_waves``.
    On the H200 the split kernel's time followed this cost within 2% over S = 5, 9, 17 at B=8/128K (session 8,
    benchmarks/results/profile_op_h200_session8c.json), where the older rule below left a last wave mostly empty.
    ``cfg["programs_per_sm"]`` set: that rule, ``bh * S ~ programs_per_sm x SMs``. ``static``: the grid of the
    static cache's call, which runs without the register cap (so with fewer programs per SM)."""
    cfg = cfg or CONFIG
    if static:
        cfg = {**cfg, "maxnreg": None}
    sms = _device_sms(device)
    bh = max(bh, 1)
    s_max = max(1, min(cdiv(n, cfg["min_split"]), cdiv(n, cfg["block_n"])))
    if cfg.get("programs_per_sm"):
        return max(1, min(cdiv(cfg["programs_per_sm"] * sms, bh), s_max))
    slots = resident_programs(cfg) * sms
    s_max = min(s_max, max(1, cfg.get("max_waves", 4) * slots // bh))
    bn = cfg["block_n"]
    # cost(S) = waves(S) * (blocks(S) + 1/2), waves non-decreasing and blocks non-increasing in S: among the S with
    # w waves the largest is cheapest, and the smallest S with its block count costs no more. So one candidate per
    # wave count instead of a scan over S (this runs on the host at every decode step of every layer).
    best, best_cost = 1, None
    for w in range(1, cdiv(bh * s_max, slots) + 1):
        s_top = min(s_max, w * slots // bh)
        if s_top < 1:
            continue
        blocks = cdiv(n, s_top * bn)
        s = cdiv(n, blocks * bn)  # the smallest S with that many blocks per split (<= s_top)
        cost = cdiv(bh * s, slots) * (blocks + 0.5)
        if best_cost is None or cost < best_cost or (cost == best_cost and s < best):
            best, best_cost = s, cost
    return best


_LOOPS = {"dequant": 0, "factored": 1, "rowdot": 2, "deferred": 3}


def _long_splits(cfg, n: int, s_hist: int) -> bool:
    """Whether ``n`` history tokens in ``s_hist`` splits (per (row, head)) make splits of at least
    ``CONFIG["gluon_long_split"]`` tokens."""
    return n >= max(s_hist, 1) * cfg.get("gluon_long_split", 0)


def gluon_k8(cfg, n: int, s_hist: int) -> int:
    """Whether the Gluon kernel takes its int8 key path for ``n`` history tokens in ``s_hist`` splits (per (row, head)):
    ``CONFIG["gluon_k8"]`` 2 always, 0 never, 1 where the splits are long (its setup, the query's int8 split, costs
    more than the fp16 path's: it pays back over a long split only)."""
    mode = int(cfg.get("gluon_k8", 0))
    return int(mode == 2 or (mode == 1 and _long_splits(cfg, n, s_hist)))


def gluon_stages(cfg, n: int, s_hist: int) -> int:
    """The Gluon kernel's pipeline stages for ``n`` history tokens in ``s_hist`` splits: ``CONFIG["gluon_stages_long"]``
    where the splits are long (and it is set), else ``CONFIG["gluon_stages"]``."""
    if cfg.get("gluon_stages_long") and _long_splits(cfg, n, s_hist):
        return int(cfg["gluon_stages_long"])
    return int(cfg.get("gluon_stages", 2))


def gluon_history_pdl(pdl_mode: int) -> int:
    """The Gluon history kernel's ``PDL`` for the op's ``CONFIG["pdl"]`` mode: 4 (the combine launched at once) is the
    kernel's 3, 5 (the combine let go after each program's loop) its 4; the others are the same number."""
    return {4: 3, 5: 4}.get(pdl_mode, pdl_mode)


def gluon_split_cfg(cfg, m: int, glu=None, n: int = 0, bh: int = 0, device=None):
    """``cfg`` as :func:`num_splits` must see it on the Gluon path (``m`` query rows a KV head): the Gluon kernel's
    step (16 or 32 tokens), its residency (``gluon_resident``) and no register cap of this file's kernel. Given the
    call's ``n`` history tokens of ``bh`` (row, KV head) pairs on ``device``: where the splits at that residency are
    long (``gluon_long_split``), the long-split residency and register cap (``gluon_resident_long``,
    ``gluon_maxnreg_long``) instead (with fewer slots the wave model picks fewer, so longer, splits)."""
    glu = glu or _gluon_module()
    out = {**cfg, "block_n": glu.tokens_per_step(m), "resident_programs": cfg.get("gluon_resident", 9), "maxnreg": None}
    if n > 0 and device is not None and cfg.get("gluon_resident_long") and _long_splits(
            out, n, num_splits(n, bh, device, out)):
        out.update(resident_programs=cfg["gluon_resident_long"],
                   gluon_maxnreg=cfg.get("gluon_maxnreg_long", cfg.get("gluon_maxnreg")))
    return out


def _few_rows(rows: int, device: torch.device) -> bool:
    """Fewer combine rows (query rows x KV heads x batch) than SMs: the combine's choices for few rows apply."""
    return device.type == "cuda" and rows < _device_sms(device)


def _pow2_below_within(s: int, slack: float) -> int:
    """``s`` splits, or the power of two below it if that is at most ``slack * s`` fewer: the combine merges a row's
    splits in tiles of a power of two (132 splits would fill a tile of 256 rows, 128 fill one of 128)."""
    p = 1 << max(s.bit_length() - 1, 0)
    return p if s > p and s - p <= slack * s else s


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, next_pow2(n))


def _mask_4d(mask, b, hk, n):
    """``mask`` (None or bool broadcastable to [B, Hk, 1, N]) -> (uint8 view expanded to [B, Hk, 1, N], ok)."""
    if mask is None:
        return None, True
    if mask.dim() != 4 or mask.shape[2] != 1 or mask.shape[3] != n or mask.shape[0] not in (1, b) or mask.shape[1] not in (1, hk):
        return None, False
    if mask.dtype != torch.bool:  # additive float masks etc.: the reference decides
        return None, False
    m = mask.expand(b, hk, 1, n)
    # Eager: a free uint8 view. Compiled (static cache): a small uint8 copy, since the functionalized
    # graph must not see a kernel argument that aliases a bool tensor.
    return (m.to(torch.uint8) if torch.compiler.is_compiling() else m.view(torch.uint8)), True


def kernel_supported(q_rot, k: QuantizedRows, group_size: int, key_mask) -> bool:
    """Shapes the kernels serve (anything else: the reference)."""
    b, hk, m, d = q_rot.shape
    n = k.codes.shape[-2]
    pow2 = lambda x: x > 0 and (x & (x - 1)) == 0  # noqa: E731
    return (
        pow2(d) and 64 <= d <= 256 and pow2(group_size) and group_size <= d and d % group_size == 0
        and 1 <= m <= 64 and _mask_4d(key_mask, b, hk, n)[1]
    )


def _rows_layout(x: QuantizedRows) -> QuantizedRows:
    """The kernel reads codes with contiguous bytes per token and metadata as contiguous
    ``[token, group]`` rows with one shared layout for scale and zero (what the cache's storage
    and its ``[:, :, :N]`` views are); anything else is copied once."""
    codes, scale, zero = x
    if codes.stride(-1) != 1:
        codes = codes.contiguous()
    ng = scale.shape[-1]
    if scale.stride(-1) != 1 or scale.stride(-2) != ng or zero.stride() != scale.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    return QuantizedRows(codes, scale, zero)


def _pairable(k: QuantizedRows, v: QuantizedRows, d: int, group_size: int) -> bool:
    """Whether the deferred loop may read both groups' bf16 scale (zero) of a token as one aligned 4-byte word."""
    return d // group_size == 2 and all(
        t.dtype == torch.bfloat16 and t.data_ptr() % 4 == 0 and all(st % 2 == 0 for st in t.stride()[:-1])
        for t in (k.scale, k.zero, v.scale, v.zero))


_READY = {}  # device -> [int32 counters of QFLAG (prologue -> history), zero between calls; the last stream]


def _ready_counters(dev: torch.device, n: int):
    """``n`` zeroed int32 counters for the prologue -> history handoff (``CONFIG["gluon_qflag"]``), one buffer per
    device: each call's combine sets them back to 0, so successive calls reuse them. A call from another stream than
    the last one's first waits for that stream's work (the last call's combine) -- except while a CUDA graph is being
    captured, whose replays must then not overlap the op on another stream. None while capturing if no buffer that
    large exists yet (the call then takes the PDL wait; allocating here would capture a memset into every replay)."""
    dev = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
    entry = _READY.get(dev)
    if torch.cuda.is_current_stream_capturing():
        return entry[0] if entry is not None and entry[0].numel() >= n else None
    stream = torch.cuda.current_stream(dev)
    if entry is not None and entry[1] != stream:
        stream.wait_stream(entry[1])  # (the buffer may still be in use there)
    if entry is None or entry[0].numel() < n:
        entry = [torch.zeros(max(n, 256), device=dev, dtype=torch.int32), stream]
        _READY[dev] = entry
    entry[1] = stream
    return entry[0]


@contextlib.contextmanager
def _counters_reset_on_error(ready):
    """Around the launches after the prologue raised ``ready``'s counters: if one fails (say, a kernel that does not
    compile), the counters are set back to 0 here (the combine that would have done it never runs), so that the next
    call's history cannot take them for its own prologue's and read its operands before they are written."""
    try:
        yield
    except BaseException:
        if ready is not None:
            ready.zero_()
        raise


@functools.lru_cache(maxsize=None)
def _gluon_module():
    """kernels/decode_gluon.py, or None where this Triton has no Gluon (it needs ``triton.experimental.gluon``)."""
    try:
        from . import decode_gluon
    except Exception:  # noqa: BLE001 -- an older Triton: the kernel of this file serves every shape
        return None
    return decode_gluon


def _launch(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, window=None, cfg=None, n_valid=None,
            splits=None, rotate=None):
    """Shared host code; ``window`` = (q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype) or None.
    ``rotate``: None (``q_rot`` / ``qk_offset`` hold the rotated query), or ``(qf, r_k, mu_k)`` from
    :func:`~oscar_hf.kernels.query_triton.rotation_args` (``q_rot`` / ``qk_offset`` are its empty outputs): the
    query is rotated here, by the first launch -- on the Gluon path the same launch as the window programs
    (:func:`_prologue_kernel`), so that the op takes three launches, not four.
    ``n_valid``: None, or a 0-d int device tensor (history entries ``< n_valid`` are valid; the grid is
    sized by the capacity and ``splits`` history programs per (row, head), so that a CUDA graph of
    this call stays valid while the cache grows)."""
    cfg = cfg or CONFIG
    b, hk, m, d = q_rot.shape
    n = k.codes.shape[-2]
    dev = q_rot.device
    q_rot = q_rot.float()
    if q_rot.stride(-1) != 1:
        q_rot = q_rot.contiguous()
    k, v = _rows_layout(k), _rows_layout(v)
    if start is None:
        start = torch.zeros(b, dtype=torch.int32, device=dev)
    elif not isinstance(start, torch.Tensor):
        start = torch.full((b,), int(start), dtype=torch.int32, device=dev)
    start = start.to(device=dev).reshape(b)
    kmask, _ = _mask_4d(key_mask, b, hk, n)
    if qk_offset is not None:
        qk_offset = qk_offset.float().expand(b, hk, m)

    m_pad = _pow2_at_least(m, cfg.get("m_pad_min", 16))
    # CONFIG was tuned for D = 128 and <= 16 query rows per KV head; other shapes take 64-token
    # blocks (the 128-token tiles would spill registers there).
    if not (d == 128 and m_pad <= 16):
        cfg = {**cfg, "block_n": 64}
    if cfg["loop"] == "deferred" and m_pad > 16:
        # its elementwise [BLOCK_N, M_PAD] tiles (sum p, max, sum p z per group) would spill registers
        # beyond 16 query rows per KV head (speculative decoding, prefill chunks): the rowdot loop serves
        cfg = {**cfg, "loop": "rowdot"}
    if n_valid is not None or not (cfg["loop"] == "deferred" and d == 128 and m_pad <= 16 and group_size >= d // 4):
        # the register cap was measured for the deferred loop's default tile only; the static cache's variant (length
        # read on the device) would spill 184 bytes under it (tests/kernels/test_compile_sm90.py)
        cfg = {**cfg, "maxnreg": None}
    bh = b * hk
    pairable = _pairable(k, v, d, group_size)
    # the Gluon kernel pays off from ~0.5 M history token-heads per call (H200, session 10: B=8 at 8K gains, B=1 at 32K
    # loses to the extra window launch and the larger merge); below that this file's kernel runs everything
    glu = _gluon_module() if (cfg.get("gluon") and q_rot.is_cuda and b * hk * n >= cfg.get("gluon_min_work", 0)) else None
    if glu is not None and not glu.gluon_supported(q_rot, k, v, group_size, kmask, pairable):
        glu = None
    if glu is not None:
        # the Gluon kernel's step (16 or 32 tokens) and residency; the static cache's `splits` (sized for this file's
        # kernel) are not used: its grid follows from the capacity alone, so it is just as fixed
        cfg = gluon_split_cfg(cfg, m, glu, n, bh, dev)
        splits = None
    few = _few_rows(bh * m, dev)  # combine programs (one per query row) fewer than SMs
    # (the static cache's own `splits` serve as given; the dynamic path sizes its grid itself)
    s_hist = ((splits if n_valid is not None and splits else num_splits(n, bh, dev, cfg)) if n > 0 else 0)
    if window is not None and few and not splits:  # the combine's tile of a row's splits full (splits_pow2_slack)
        s_hist = _pow2_below_within(s_hist, cfg.get("splits_pow2_slack") or 0)
    if n_valid is not None:  # static: fixed grid, split bounds computed in the kernel from n_valid
        split_len = 0
    else:
        split_len = cdiv(cdiv(max(n, 1), max(s_hist, 1)), cfg["block_n"]) * cfg["block_n"]
        s_hist = cdiv(n, split_len) if n > 0 else 0  # drop splits that would be empty
    fused = window is not None
    if fused:
        q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype = window
        w = 0 if k_win is None else k_win.shape[-2]
        win_split = cfg["win_split"]
        gws = cfg.get("gluon_win_split")
        if glu is not None and gws and bh * cdiv(w, gws) <= 8 * _device_sms(dev):
            win_split = gws
        s_win = cdiv(w, win_split)
        if w:
            q_win = q_win if q_win.stride(-1) == 1 else q_win.contiguous()
            k_win = k_win if k_win.stride(-1) == 1 else k_win.contiguous()
            v_win = v_win if v_win.stride(-1) == 1 else v_win.contiguous()
        wmask, _ = _mask_4d(win_mask, b, hk, w)
        r_v = r_v.to(device=dev, dtype=torch.float32).contiguous()
        mu_v = None if mu_v is None else mu_v.to(device=dev, dtype=torch.float32).contiguous()
    else:
        w, s_win, wmask, win_split = 0, 0, None, cfg["win_split"]
        q_win = k_win = v_win = r_v = mu_v = None
    s_tot = s_hist + s_win
    # programmatic dependent launch (sm_90+) when the history runs on the Gluon kernel: each launch of the call may
    # start before the one before it completes -- the Gluon kernel's setup under the query rotation, the window
    # programs (which read nothing the history writes) in the history kernel's tail, the combine's R_V load -- and
    # waits (griddepcontrol.wait) before it reads what that one writes
    # pdl 2: only the rotation's launch and the history kernel, which loads its first steps before it waits; only where
    # this call launches the rotation itself, right before the history (what the history reads before its wait must be
    # complete before the launch it overlaps)
    # pdl 4: pdl 2, and the combine under PDL: the history kernel lets it launch at once, so that its programs load R_V
    # in the history's tail; pdl 5: the same, but each history program lets it launch only after its loop (the
    # combine's grid starts once the last history program is past its loop, not beside the whole history)
    pdl_mode = int(cfg.get("pdl") or 0) if (glu is not None and s_hist and dev.type == "cuda"
                                            and cuda_major(dev) >= 9) else 0
    if pdl_mode >= 2 and rotate is None:
        pdl_mode = 0
    pdl = pdl_mode == 1
    pdl_comb = pdl_mode in (1, 4, 5)  # the combine's launch
    pdl_kw = {"launch_pdl": True} if pdl else {}

    pm = torch.empty(bh, max(s_tot, 1), m, device=dev, dtype=torch.float32)
    pl = torch.empty_like(pm)
    pacc = torch.empty(bh, max(s_tot, 1), m, d, device=dev, dtype=torch.float32)
    ready = None
    timed = False
    if s_tot == 0:  # nothing to attend to: one empty partial
        pm.fill_(float("-inf"))
        pl.zero_()
        pacc.zero_()
        s_tot = 1
    else:
        z3 = (0, 0, 0)
        pid_off = 0
        fp = cfg.get("fused_prologue", 1)  # 2: on the Triton path too (its window programs leave the history launch)
        fused_pro = bool(rotate is not None and s_hist and s_win and (fp == 2 or (fp == 1 and glu is not None)))
        k8 = gluon_k8(cfg, n, s_hist) if glu is not None else 0
        # the int8 key path's query operands built once per (row, KV head) by the prologue's rotation programs, one per
        # plane (CONFIG["gluon_qpre"]), not by every history program
        qpre = bool(fused_pro and k8 and cfg.get("gluon_qpre"))
        # ... and the history programs' wait for them: on counters the rotation programs raise, not the PDL wait for
        # the whole prologue grid (CONFIG["gluon_qflag"])
        ready = _ready_counters(dev, bh) if (qpre and pdl_mode >= 2 and cfg.get("gluon_qflag")) else None
        c_rot = min(d, ROT_C_BLOCK)
        qp8 = qpf = None
        if qpre:
            tb = glu.tokens_per_step(m) // 16
            qp8 = torch.empty(bh * Q8_TILE_BYTES * tb, device=dev, dtype=torch.int8)
            qpf = torch.empty(bh * Q8_FIELDS, device=dev, dtype=torch.float32)
        timed = glu is not None and glu.TIMES_BUF is not None  # diagnostic timestamps (both launches stamp)
        if timed:
            _check_times_buf(glu.TIMES_BUF, glu.TIME_SLOTS.value, bh * s_hist,
                             bh * (d // c_rot + s_win) if fused_pro else 0)
        if rotate is not None:
            qf_r, r_k_r, mu_k_r = rotate
            if fused_pro:  # rotation + window programs in one launch (the window's query is qf_r: see the caller)
                _prologue_kernel[(bh, d // c_rot + s_win)](
                    qf_r, r_k_r, mu_k_r, q_rot, qk_offset, k_win, v_win, wmask, pm, pl, pacc,
                    m, hk, s_hist, s_tot, w, win_split, float(scaling) * LOG2E, *rotation_strides(qf_r, mu_k_r),
                    *k_win.stride()[:3], *v_win.stride()[:3],
                    *(wmask.stride()[0], wmask.stride()[1], wmask.stride()[3]) if wmask is not None else z3,
                    D=d, M_PAD=m_pad, M_PAD_ROT=max(16, m_pad), C_BLOCK=c_rot, HAS_MU=mu_k_r is not None,
                    HAS_WMASK=wmask is not None, LOWP=int(q_rot.is_cuda),
                    WIN_STAGES=int(cfg.get("gluon_win_stages", 1)), PDL=int(pdl_mode >= 2),
                    TIMES=glu.TIMES_BUF if timed else None, TIMED=int(timed),
                    TIME_SLOTS=glu.TIME_SLOTS.value if timed else 8,
                    QP8=qp8, QPF=qpf, QPRE=int(qpre), TB=glu.tokens_per_step(m) // 16 if qpre else 2,
                    READY=ready, QFLAG=int(ready is not None),
                    num_warps=cfg.get("prologue_warps") or cfg["num_warps"],
                )
            else:
                launch_rotation(qf_r, r_k_r, mu_k_r, q_rot, qk_offset)
        if glu is not None:  # history on the Gluon kernel; this file's kernel runs the window programs only
            if s_hist:
                with _counters_reset_on_error(ready):
                    glu.launch_history(q_rot, k, v, start, qk_offset, n_valid, pm, pl, pacc, n, s_hist, s_tot,
                                       split_len, float(scaling) * LOG2E, stages=gluon_stages(cfg, n, s_hist),
                                       splitk=int(cfg.get("gluon_splitk", 0)), maxnreg=cfg.get("gluon_maxnreg"),
                                       l2pf=int(cfg.get("gluon_l2pf", 0)), gsum=int(cfg.get("gluon_gsum", 0)),
                                       pdl=gluon_history_pdl(pdl_mode),
                                       early=int(cfg.get("gluon_early", 0)), k8=k8,
                                       qpre=(qp8, qpf) if qpre else None, ready=ready)
            pid_off = s_hist
        s_run = s_hist if fused_pro else s_tot  # the window programs ran in the prologue launch
        if s_run > pid_off:
            _split_kernel[(bh, s_run - pid_off)](
                q_rot, *k, *v, start, kmask, qk_offset, n_valid,
                q_win, k_win, v_win, wmask,
                pm, pl, pacc,
                n, m, hk, s_hist, s_tot, split_len, w, win_split, float(scaling) * LOG2E, pid_off,
                *q_rot.stride()[:3],
                *k.codes.stride()[:3], *k.scale.stride()[:2],
                *v.codes.stride()[:3], *v.scale.stride()[:2],
                *(kmask.stride()[0], kmask.stride()[1], kmask.stride()[3]) if kmask is not None else z3,
                *qk_offset.stride() if qk_offset is not None else z3,
                *(q_win.stride()[:3] if w else z3), *(k_win.stride()[:3] if w else z3), *(v_win.stride()[:3] if w else z3),
                *(wmask.stride()[0], wmask.stride()[1], wmask.stride()[3]) if wmask is not None else z3,
                D=d, G=group_size, M_PAD=m_pad, BLOCK_N=cfg["block_n"],
                HAS_MASK=kmask is not None, HAS_OFF=qk_offset is not None,
                HAS_WIN=s_win > 0 and not fused_pro, HAS_WMASK=wmask is not None, LOWP=int(q_rot.is_cuda),
                LOOP=_LOOPS[cfg["loop"]] if group_size >= d // 4 else 0,  # rowdot/factored: each plane in one group
                N_DEV=n_valid is not None,
                PREFETCH=int(cfg.get("prefetch", 0)) if q_rot.is_cuda else 0,  # inline PTX: not under the interpreter
                PAIR=int(cfg.get("pair_meta", False) and pairable),
                AHEAD=int(cfg.get("meta_ahead", False)),
                ASM=int(cfg.get("asm_codes", 0)) if q_rot.is_cuda else 0,  # inline PTX: not under the interpreter
                # D = 256 or 64 query rows: 8 warps (and 2 stages for D = 256) keep the tiles in registers
                # (checked without spills by tests/kernels/test_compile_sm90.py)
                num_warps=8 if (d > 128 or m_pad >= 64) else cfg["num_warps"],
                num_stages=2 if d > 128 else cfg["num_stages"],
                PDL=int(pdl), WIN_STAGES=int(cfg.get("gluon_win_stages", 1)) if pid_off else 1, WIN_ONLY=int(pid_off > 0),
                **pdl_kw,
                **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}),
            )
    s_block = min(_pow2_at_least(max(s_hist, s_win, 1), 1),
                  cfg.get("merge_block_few" if few else "merge_block") or cfg.get("merge_block", 64))
    if fused:
        # Session 21: few -> merge_out_parts programs a row of merge_warps_few warps each (CONFIG).
        # combine programs (one per query row): few -> 8 warps, the whole R_V[h] loaded with the partials; many (at
        # least one per SM) -> 4 warps, R_V in 32-row chunks, so that more programs fit an SM (H200: B=32/32K 31 -> 18
        # us, the op 330 -> 317 us, session 11 run d; B=8/128K 13.8 -> 9.9 us, the op 245.7 -> 241.9, session 13 run a;
        # B=1 (32 rows) 9.2 -> 9.9 us: not there). Since session 16 (merge_hoist) R_V in 64-row chunks for both at
        # D = 128, the next chunk's load ahead of its use
        # Session 17: where there are at least merge_one_warp_rows rows per SM, one warp per row, R_V in 16-row chunks
        # and at most 16 splits a round, so that a warp holds them without spilling (H200, B=32/32K, 1024 rows: combine
        # 15.1 -> 10.4 us, the op 231.6 -> 225.7, profile_op_h200_session17f.json; 32-row chunks spill 128 bytes for
        # 9.1-9.2 us; one warp at B=8, 256 rows: 6.8 -> 13.0 us, profile_op_h200_session17e.json)
        many = not few and dev.type == "cuda"
        crowd = many and d <= 128 and bh * m >= cfg.get("merge_one_warp_rows", 4) * _device_sms(dev)
        # merge_warps_few: measured at D = 128 with a row's splits in one tile of <= 128 (4 warps on a 256-row tile
        # were slower than 8)
        few_warps = cfg.get("merge_warps_few") if (d == 128 and s_block <= 128) else None
        merge_warps = cfg.get("merge_warps") or (1 if crowd else 4 if many or d < 128 else few_warps or 8)
        c_block = min(d, cfg.get("merge_cblock") or (16 if crowd else
            64 if cfg.get("merge_hoist") and d == 128 else (32 if many or d > 128 else d)))
        if crowd and merge_warps == 1:  # a [S_BLOCK, D] tile of partials in one warp's registers
            s_block = min(s_block, 16)
        # fewer rows than SMs: merge_out_parts programs a row, each un-rotating a slice of the output channels
        parts = int(cfg.get("merge_out_parts") or 1) if few else 1
        if parts > 1:
            c_block = min(c_block, d // parts)
        out = torch.empty(b, hk, m, d, device=dev, dtype=out_dtype)
        hoist = (bool(cfg.get("merge_hoist")) and c_block < d <= 128
                 and s_tot - s_hist <= cfg.get("merge_hoist_win", 16))
        if timed and hoist:
            _check_times_buf(glu.TIMES_BUF, glu.TIME_SLOTS.value, 0, 0, bh * m * parts)
        with _counters_reset_on_error(ready):
            _combine_kernel[(bh * m * parts,)](
                pm, pl, pacc, None, None, out, r_v, mu_v, m, hk, s_hist, s_tot,
                D=d, S_BLOCK=s_block, C_BLOCK=c_block, FINAL=True, HAS_MUV=mu_v is not None, PDL=int(pdl_comb),
                HOIST=int(hoist), SW_BLOCK=_pow2_at_least(s_tot - s_hist, 1) if hoist else 1, PARTS=parts,
                READY=ready, RESET=int(ready is not None),
                TIMES=glu.TIMES_BUF if timed and hoist else None, TIMED=int(timed and hoist),
                TIME_SLOTS=glu.TIME_SLOTS.value if timed else 8,
                num_warps=merge_warps,
                **({"launch_pdl": True} if pdl_comb else {}),
            )
        return out
    om = torch.empty(b, hk, m, device=dev, dtype=torch.float32)
    ol = torch.empty_like(om)
    oacc = torch.empty(b, hk, m, d, device=dev, dtype=torch.float32)
    _combine_kernel[(bh * m,)](
        pm, pl, pacc, om, ol, oacc, None, None, m, hk, s_tot, s_tot,
        D=d, S_BLOCK=s_block, C_BLOCK=min(d, 32), FINAL=False, HAS_MUV=False, PDL=int(pdl), HOIST=0, SW_BLOCK=1,
        num_warps=4, **pdl_kw,
    )
    return om, ol, oacc


def history_partial_triton(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, block_n=None):
    """Triton version of :func:`~oscar_hf.kernels.int2_attention.history_partial_reference` (same
    contract; ``block_n`` is accepted for signature compatibility and ignored: the kernel's tile is
    ``CONFIG["block_n"]``). Two launches."""
    from .int2_attention import history_partial_reference

    if not kernel_supported(q_rot, k, group_size, key_mask):
        return history_partial_reference(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size, block_n or 1024)
    return _launch(q_rot, k, v, start, key_mask, qk_offset, scaling, group_size)


# ----------------------------------------------------------------------------------------------
# the full decode attention op


# The torch reference of the fused op lives beside the history reference (triton-free module).
from .int2_attention import decode_attention_reference  # noqa: E402


def decode_attention_triton(
    q_rot, k, v, start, key_mask, qk_offset, scaling, group_size,
    q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype=None, n_valid=None, splits=None,
):
    """Decode attention of one layer over INT2 history + full-precision window, in two launches.

    Args (``B`` batch, ``Hk`` KV heads, ``M`` query rows per KV head, ``D`` head_dim):
        q_rot, k, v, start, key_mask, qk_offset, scaling, group_size: as for ``history_partial``
            (history keys/values rotated by R_K/R_V and centered).
        q_win: ``[B, Hk, M, D]`` the *unrotated* queries (any float dtype), for the window keys.
        k_win, v_win: ``[B, Hk, W, D]`` unrotated full-precision window (sink + recent, one buffer),
            or None.
        win_mask: None or bool broadcastable to ``[B, Hk, 1, W]`` (False = masked).
        r_v: ``[Hk, D, D]`` float32 value rotation; mu_v: ``[Hk, D]`` or None.
        out_dtype: dtype of the result (default: q_win's).
        n_valid, splits: the static cache's device-side history length (0-d int tensor) and its
            fixed number of history splits (see :func:`_launch`); None for the dynamic cache.
    Returns ``[B, Hk, M, D]``: softmax attention over history and window, in the value space.
    Rows without any valid key are 0. Unsupported shapes or masks fall back to the reference.
    """
    out_dtype = out_dtype or (q_win.dtype if q_win is not None else torch.float32)
    b, hk, _, _ = q_rot.shape
    w = 0 if k_win is None else k_win.shape[-2]
    if not kernel_supported(q_rot, k, group_size, key_mask) or not _mask_4d(win_mask, b, hk, w)[1]:
        return decode_attention_reference(
            q_rot, k, v, start, key_mask, qk_offset, scaling, group_size,
            q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype, n_valid=n_valid,
        )
    return _launch(
        q_rot, k, v, start, key_mask, qk_offset, scaling, group_size,
        window=(q_win, k_win, v_win, win_mask, r_v, mu_v, out_dtype), n_valid=n_valid, splits=splits,
    )


def decode_attention_rotating_triton(
    qf, r_k, mu_k, k, v, start, key_mask, scaling, group_size,
    k_win, v_win, win_mask, r_v, mu_v, out_dtype=None, n_valid=None, splits=None,
):
    """:func:`decode_attention_triton` from the unrotated query: ``qf [B, Hk, M, D]`` is rotated here (``q R_K`` and
    ``q · mu_K``, :func:`~oscar_hf.kernels.int2_attention.rotate_query_reference`; ``r_k [Hk, D, D]``, ``mu_k`` None,
    ``[Hk, D]`` or ``[B, Hk, D]``) and is also the window's query. Three launches on the Gluon path (rotation +
    window, history, combine), else the rotation's launch and :func:`decode_attention_triton`'s two."""
    from .int2_attention import rotate_query_reference
    from .query_triton import query_kernel_supported, rotation_args

    b, hk, m, d = qf.shape
    out_dtype = out_dtype or qf.dtype
    w = 0 if k_win is None else k_win.shape[-2]
    if not (query_kernel_supported(qf) and kernel_supported(qf, k, group_size, key_mask)
            and _mask_4d(win_mask, b, hk, w)[1]):
        q_rot, qk_off = rotate_query_reference(qf, r_k, mu_k)
        return decode_attention_triton(q_rot, k, v, start, key_mask, qk_off, scaling, group_size, qf, k_win, v_win,
                                       win_mask, r_v, mu_v, out_dtype, n_valid=n_valid, splits=splits)
    qf_r, r_k_r, mu_k_r, q_rot, qk_off = rotation_args(qf, r_k, mu_k)
    return _launch(
        q_rot, k, v, start, key_mask, qk_off, scaling, group_size,
        window=(qf_r, k_win, v_win, win_mask, r_v, mu_v, out_dtype), n_valid=n_valid, splits=splits,
        rotate=(qf_r, r_k_r, mu_k_r),
    )


from .int2_attention import decode_attention  # noqa: E402  (the dispatcher: kernels on CUDA, reference elsewhere)


__all__ = [
    "CONFIG", "history_partial_triton", "decode_attention_triton", "decode_attention_rotating_triton",
    "decode_attention_reference",
    "decode_attention", "num_splits", "resident_programs", "kernel_supported", "gluon_k8", "gluon_stages",
    "gluon_history_pdl",
    "gluon_split_cfg",
]
