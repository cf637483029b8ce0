"""Launch planning of the kernels: where a call runs, the named defaults, the split-K policy and launch shapes.

Plain Python and torch only (no Triton import), so that the cache can size its grid and the package can be
imported on machines without Triton.

* :mod:`~oscar_hf.kernels.settings` (re-exported here): :func:`triton_enabled` and the named defaults
  (:class:`DecodeDefaults` / :data:`DEFAULTS`, the retrieval heads' :class:`HeadsDefaults`).
* :func:`num_splits`: the split-K factor (the wave model), and the choices that follow from a call's shape:
  the Gluon kernel's long-split path (:func:`gluon_plan`), the combine kernel's launch (:func:`combine_shape`).
* :func:`decode_plan` / :class:`DecodePlan`: all of them for one decode call (which kernels, grids, tiles, register
  caps, PDL), from its shapes and flags; the launchers read only the plan.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from .settings import (DEFAULTS, HEADS_DEFAULTS, DecodeDefaults, HeadsDefaults, cdiv, next_pow2,  # noqa: F401
                       pow2_at_least, settle_cache_keys, triton_enabled, triton_importable)

# ---- the shapes the Triton kernels serve (the tests in tests/kernels parametrize over the same tuples)

# head_dims of the decode read (split kernel, combine, query rotation) and of the writes (prefill, the decode step's
# append; also 32 there). A power of two, or 96 (Phi-3): the kernels pad a non-power-of-two head_dim to the next
# power of two inside (tl.arange takes powers of two only), masking the padded channels (DP, D4P in the kernels).
KERNEL_HEAD_DIMS = (64, 96, 128, 256, 512)
WRITE_HEAD_DIMS = (32, *KERNEL_HEAD_DIMS)


def group_fits(d: int, group_size: int) -> bool:
    """Whether the kernels take ``group_size`` channels per scale / zero at head_dim ``d``: a divisor of ``d`` that is
    a power of two (planes of ``D/4`` channels then lie inside a group, or groups inside a plane, whenever ``d`` is a
    power of two) or a whole number of planes (24, 48, 96 at ``d = 96``)."""
    g = group_size
    return g > 0 and d % g == 0 and ((g & (g - 1)) == 0 or g % (d // 4) == 0)


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def cuda_major(device: torch.device) -> int:
    """Compute capability major of a CUDA device (cached: ``get_device_capability`` costs ~10 us a call)."""
    return _cuda_major(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device (its index, or the current one); 4 elsewhere (the interpreter's stand-in)."""
    if device.type != "cuda":
        return 4
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


M_PAD_MIN = 16  # smallest query-row tile of the split kernel (tl.dot needs 16; 8 was slower: docs/kernels.md)


def resident_programs(defaults: DecodeDefaults = DEFAULTS, maxnreg: int | None = -1) -> int:
    """Split-kernel programs one SM holds at once: from the register cap (``65536 // (maxnreg * 32 * num_warps)``, 3
    at 168), else 2 (ptxas takes 238-255 registers x 128 threads for the default tile). ``maxnreg`` -1: the
    defaults' cap."""
    cap = defaults.maxnreg if maxnreg == -1 else maxnreg
    if cap:
        return max(1, 65536 // (cap * 32 * defaults.num_warps))
    return 2


def wave_splits(n: int, bh: int, sms: int, block_n: int, min_split: int, max_waves: int, resident: int) -> int:
    """The wave model: the GPU runs ``slots = resident x SMs`` programs at once, so ``bh * S`` programs take
    ``ceil(bh * S / slots)`` waves, each as long as one split, ``ceil(n / S)`` tokens (plus half a block for the
    deferred loop's reference prologue). Take the ``S`` of least ``waves x blocks per split`` (the smallest on ties:
    fewer partials to merge), at least ``min_split`` tokens per split, at most ``max_waves``."""
    bh = max(bh, 1)
    s_max = max(1, min(cdiv(n, min_split), cdiv(n, block_n)))
    slots = resident * sms
    s_max = min(s_max, max(1, max_waves * slots // bh))
    # cost(S) = waves(S) * (blocks(S) + 1/2), waves non-decreasing and blocks non-increasing in S: among the S with
    # w waves the largest is cheapest, and the smallest S with its block count costs no more. So one candidate per
    # wave count instead of a scan over S (this runs on the host at every decode step of every layer).
    best, best_cost = 1, None
    for w in range(1, cdiv(bh * s_max, slots) + 1):
        s_top = min(s_max, w * slots // bh)
        if s_top < 1:
            continue
        blocks = cdiv(n, s_top * block_n)
        s = cdiv(n, blocks * block_n)  # the smallest S with that many blocks per split (<= s_top)
        cost = cdiv(bh * s, slots) * (blocks + 0.5)
        if best_cost is None or cost < best_cost or (cost == best_cost and s < best):
            best, best_cost = s, cost
    return best


def num_splits(n: int, bh: int, device: torch.device, defaults: DecodeDefaults | None = None,
               static: bool = False) -> int:
    """Split-K factor ``S`` of the Triton split kernel for ``bh`` (row, KV head) pairs of ``n`` history tokens
    (:func:`wave_splits`). ``static``: the grid of the static cache's call, which runs without the register cap (so
    with fewer programs per SM)."""
    d = defaults or DEFAULTS
    resident = resident_programs(d, None if static else d.maxnreg)
    return wave_splits(n, bh, device_sms(device), d.block_n, d.min_split, d.max_waves, resident)


class GluonPlan(NamedTuple):
    """The Gluon history kernel's grid for one call."""

    block_n: int  # tokens per step (16 or 32)
    splits: int  # history splits per (row, KV head), from the wave model at the chosen residency
    maxnreg: int  # ptxas register cap


def long_splits(defaults: DecodeDefaults, n: int, s_hist: int) -> bool:
    """Whether ``n`` history tokens in ``s_hist`` splits make splits of at least ``gluon_long_split`` tokens: then the
    Gluon kernel takes int8 key MMAs (their setup pays back over a long split only) and ``gluon_stages_long``."""
    return n >= max(s_hist, 1) * defaults.gluon_long_split


def gluon_query_groups(m: int, d: int) -> int:
    """Programs per (row, KV head) of the Gluon history kernel, each for ``m / groups`` query rows: 2 at D = 64 with 5
    to 8 rows (an even number; its logit columns hold two tokens' columns for <= 4 rows), else 1."""
    return 2 if (d == 64 and 4 < m <= 8 and m % 2 == 0) else 1


def tokens_per_step(m: int, d: int = 128) -> int:
    """Tokens per step of the Gluon history kernel: two token sets of 16 (TB = 2) where <= 4 query rows leave half the
    logit tile's 8 columns free, at D = 128 only (D = 256: its 8 chunk accumulators and query operands fill the
    registers at TB = 1); at D = 64 16 code rows of two tokens (for each query group's <= 4 rows)."""
    return 32 if ((m <= 4 and d == 128) or d == 64) else 16


def gluon_plan(defaults: DecodeDefaults, tokens_per_step: int, n: int, bh: int, device: torch.device,
               head_dim: int = 128) -> GluonPlan:
    """Where the splits at the short-split residency (``gluon_resident``) are long, the long splits' residency and
    register cap instead (with fewer slots the wave model picks fewer, so longer, splits). ``head_dim`` 256: its own
    residency and cap at every split length; 64: the short splits' at every split length (no int8 keys)."""
    d = defaults
    sms = device_sms(device)

    def splits(resident):
        return wave_splits(n, bh, sms, tokens_per_step, d.min_split, d.max_waves, resident)

    if head_dim == 256:
        return GluonPlan(tokens_per_step, splits(d.gluon_resident_wide) if n > 0 else 0, d.gluon_maxnreg_wide)
    resident, maxnreg = d.gluon_resident, d.gluon_maxnreg
    if n > 0 and head_dim == 128 and long_splits(d, n, splits(resident)):
        resident, maxnreg = d.gluon_resident_long, d.gluon_maxnreg_long
    return GluonPlan(tokens_per_step, splits(resident) if n > 0 else 0, maxnreg)


def few_rows(rows: int, device: torch.device) -> bool:
    """Fewer combine rows (query rows x KV heads x batch) than SMs: the combine's choices for few rows apply."""
    return device.type == "cuda" and rows < device_sms(device)


def pow2_below_within(s: int, slack: float) -> int:
    """``s`` splits, or the power of two below it if that is at most ``slack * s`` fewer: the combine merges a row's
    splits in tiles of a power of two (132 splits would fill a tile of 256 rows, 128 fill one of 128)."""
    p = 1 << max(s.bit_length() - 1, 0)
    return p if s > p and s - p <= slack * s else s


class CombineShape(NamedTuple):
    s_block: int  # split partials merged per step
    c_block: int  # output channels per un-rotation step
    warps: int
    parts: int  # programs per query row
    hoist: bool  # the window partials and R_V's first chunk loaded with the history partials


def merge_step(defaults: DecodeDefaults, s_hist: int, s_win: int, few: bool, d: int = 128) -> int:
    """Split partials the combine merges per step: all of a row's (a power of two), at most ``merge_block``
    (``merge_block_few`` where the combine has fewer rows than SMs; ``merge_block_xwide`` at head_dims above 256, whose
    ``[S_BLOCK, D]`` tile of partials sits in registers)."""
    cap = defaults.merge_block_xwide if d > 256 else defaults.merge_block_few if few else defaults.merge_block
    return min(pow2_at_least(max(s_hist, s_win, 1), 1), cap)


def combine_shape(defaults: DecodeDefaults, d: int, rows: int, s_hist: int, s_win: int, device: torch.device,
                  few: bool) -> CombineShape:
    """The decode op's combine launch for ``rows`` query rows (B x Hk x M) of head_dim ``d``. Few rows (fewer than
    SMs): ``merge_out_parts`` programs a row of ``merge_warps_few`` warps; many: 4 warps, R_V in chunks; crowded
    (``merge_one_warp_rows`` rows per SM): one warp per row, R_V in 16-row chunks, at most 16 splits a round."""
    df = defaults
    s_block = merge_step(df, s_hist, s_win, few, d)
    many = not few and device.type == "cuda"
    crowd = many and d <= 128 and rows >= df.merge_one_warp_rows * device_sms(device)
    few_warps = df.merge_warps_few if (d == 128 and s_block <= 128) else None
    warps = 1 if crowd else 4 if many or d < 128 else few_warps or 8
    # output channels in power-of-two chunks that divide D (D = 96: 32 or 16)
    c_block = min(d, 16 if crowd else 64 if d == 128 else (32 if many or d > 128 else d), d & -d)
    if crowd:  # a [S_BLOCK, D] tile of partials in one warp's registers
        s_block = min(s_block, 16)
    parts = df.merge_out_parts if few else 1
    if parts > 1:
        if d & (d - 1):  # D = 96: each program whole chunks (3 programs of 32 channels, not 4 of 24)
            parts = max(p for p in range(1, parts + 1) if (d // c_block) % p == 0)
        c_block = min(c_block, d // parts)
    hoist = c_block < d <= 128 and s_win <= df.merge_hoist_win
    return CombineShape(s_block, c_block, warps, parts, hoist)


# ---- the decode op's launch plan: every decision of one call, made once from shapes and flags (FlashInfer's plan();
# the launchers in decode_triton.py and paged_decode.py then only allocate, launch and read the plan)


def gluon_pays(defaults: DecodeDefaults, bh: int, n: int) -> bool:
    """Whether the Gluon history kernel pays for its extra launch: from ``gluon_min_work`` (~0.5 M) history
    token-heads per call, ``bh`` (row, KV head) pairs of ``n`` tokens (docs/kernels.md); below, the split kernel runs
    everything."""
    return bh * n >= defaults.gluon_min_work


def fused_prologue(gluon: bool) -> bool:
    """Whether the op from the unrotated query launches the rotation with the window programs (``_prologue_kernel``)
    where it has both history and window: on the Gluon path, whose window programs leave the history's launch anyway
    (tests force it on the split-kernel path, to run that launch under the interpreter)."""
    return gluon


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The launches of one decode call (:func:`decode_plan`). Per (row, KV head): ``s_hist`` history partials, then
    ``s_win`` window partials, merged by the combine."""

    gluon: bool  # the history on the Gluon kernel (decode_gluon); the split kernel then runs the window programs only
    m_pad: int  # the split kernel's query rows per tile (a power of two >= M_PAD_MIN)
    block_n: int  # history tokens per inner step (on the Gluon path: its step, 16 or 32)
    deferred: bool  # the split kernel's deferred inner loop (else the dequant loop)
    maxnreg: int | None  # the split kernel's ptxas register cap (None: none; never on the Gluon path)
    gluon_maxnreg: int  # the Gluon kernel's register cap (0 off its path)
    gluon_stages: int  # its cp.async pipeline stages (0 off its path)
    k8: bool  # its int8 key MMAs (long splits)
    s_hist: int  # history splits (programs) per (row, KV head)
    split_len: int  # history tokens per split (0: static, the kernels derive the bounds from n_valid on the device)
    s_win: int  # window programs per (row, KV head)
    win_split: int  # window tokens per window program
    s_tot: int  # partials per (row, KV head) the combine reads: s_hist + s_win, or 1 (an empty one) if both are 0;
    # one more with an attention sink (the last)
    fused_prologue: bool  # the query rotation launched with the window programs (_prologue_kernel)
    qpre: bool  # ... which also build the int8 key path's query operands
    pdl: bool  # programmatic dependent launch: prologue -> history -> combine
    ready: bool  # the history programs wait on counters the rotation programs raise (QFLAG), not the PDL wait
    tb: int  # the prologue's token sets per Gluon step (TB; 2 where unused)
    pid_off: int  # the split kernel's first program: s_hist on the Gluon path (window programs only), else 0
    split_programs: int  # its programs per (row, KV head) (0: no launch)
    split_window: bool  # its window programs run (HAS_WIN): not where the prologue ran them
    split_warps: int
    split_stages: int
    win_stages: int  # the window programs' software pipeline (WIN_STAGES)
    combine: CombineShape
    sw_block: int  # the combine's tile of window partials where it hoists their loads (SW_BLOCK)

    @property
    def empty(self) -> bool:
        """Nothing to attend to: no history and no window (the launcher writes one empty partial)."""
        return self.s_hist + self.s_win == 0


class DecodeShape(NamedTuple):
    """A decode call's shape: ``B = b`` rows, ``Hk = hk`` KV heads, ``M = m`` query rows of head_dim ``d`` per KV head,
    ``n`` INT2 history tokens (the capacity where the length is on the device) of ``group_size``, ``w`` window ones."""

    b: int
    hk: int
    m: int
    d: int
    n: int
    group_size: int
    w: int


def decode_plan(shape: DecodeShape, device: torch.device, *, window: bool = True, static: bool = False,
                splits: int | None = None, rotate: bool = False, gluon_step: int = 0, page: int = 0,
                sinks: bool = False, softcap: bool = False, defaults: DecodeDefaults = DEFAULTS) -> DecodePlan:
    """The launch plan of one decode call of ``shape`` on ``device`` (its SMs and compute capability), no tensor.

    window: the whole op (window programs, normalized output); False: the history's partials only.
    static: the history length is read on the device (the static cache's ``n_valid``): the grid follows from the
        capacity and ``splits`` (the cache's fixed split count; None: the wave model's), so a CUDA graph stays valid.
    rotate: the op rotates the query itself (its first launch).
    gluon_step: the Gluon kernel's tokens per step where it serves this call's tensors
        (``decode_gluon.gluon_supported`` / ``tokens_per_step``: D = 128 or 256; D = 64 with ``M <= 4``, or an even
        ``M <= 8`` in two query groups), 0 where not.
    page: entries per page of a paged history (the serving pool, ``paged_decode``), 0 for a contiguous one.
    sinks: one more partial per row after the window's, which the launcher fills with the attention sink's logit
        (``m = s``, ``l = 1``, ``acc = 0``): the combine merges it like a window partial, so no kernel knows of sinks.
    softcap: the logits are soft-capped (Gemma 2): the split kernel caps them (``SOFTCAP``); the Gluon kernel does
        not, so the split kernel serves the history whatever ``gluon_step`` says.
    """
    df, (b, hk, m, d, n, group_size, w) = defaults, shape
    bh = b * hk
    m_pad = pow2_at_least(m, M_PAD_MIN)
    # the defaults were tuned for D = 128 and <= 16 query rows per KV head; other shapes take 64-token blocks (larger
    # tiles would spill registers there), D = 512 32-token ones
    block_n = df.block_n if (d == 128 and m_pad <= 16) else df.block_n_xwide if d > 256 else df.block_n_other
    if page >= 16 and page & (page - 1) == 0:  # pages of a power of two: a block in one page, one table load a block
        block_n = min(block_n, page)
    # the deferred loop: each plane (D/4 channels) inside one group, G a multiple of D/4, and at most 16 query rows per
    # KV head (its elementwise [BLOCK_N, M_PAD] tiles would spill registers beyond); the dequant loop serves the rest
    deferred = group_size % (d // 4) == 0 and m_pad <= 16
    # the register cap was measured for the deferred loop's default tile over a contiguous history only; the static
    # cache's variant (length read on the device) would spill 184 bytes under it (tests/kernels/test_compile_sm90.py)
    maxnreg = df.maxnreg if (not static and not page and deferred and d == 128) else None
    qg = gluon_query_groups(m, d)
    # D = 64 with 5-8 query rows per KV head (gpt-oss 64 / 8): two programs per (row, KV head), each for half the rows
    # (the kernel's logit columns hold <= 4 at D = 64); H200, 64 / 8 heads: B=8/128K 0.76x -> 1.92x BF16 SDPA
    gluon = gluon_step > 0 and not softcap and gluon_pays(df, bh, n) and (d != 64 or m <= 4 or qg > 1)
    if gluon:
        # the Gluon kernel's step and residency (its programs: qg per (row, KV head)); the static cache's `splits`
        # (sized for the split kernel) are not used: its grid follows from the capacity alone, so it is just as fixed
        gp = gluon_plan(df, gluon_step, n, bh * qg, device, d)
        block_n, maxnreg, splits = gp.block_n, None, None
    few = few_rows(bh * m, device)  # combine programs (one per query row) fewer than SMs
    if n == 0:
        s_hist = 0
    elif static and splits:  # the static cache's own `splits` serve as given
        s_hist = splits
    elif gluon:
        s_hist = gp.splits
    else:
        s_hist = wave_splits(n, bh, device_sms(device), block_n, df.min_split, df.max_waves,
                             resident_programs(df, maxnreg))
    if window and few and not splits:  # the combine's tile of a row's splits full (splits_pow2_slack)
        s_hist = pow2_below_within(s_hist, df.splits_pow2_slack)
    if static:  # fixed grid, split bounds computed in the kernel from n_valid
        split_len = 0
    else:
        split_len = cdiv(cdiv(max(n, 1), max(s_hist, 1)), block_n) * block_n
        s_hist = cdiv(n, split_len) if n > 0 else 0  # drop splits that would be empty
    win_split = df.win_split
    # few window programs on the Gluon path: their own launch, after the history, is on the critical path
    if window and gluon and bh * cdiv(w, df.gluon_win_split) <= 8 * device_sms(device):
        win_split = df.gluon_win_split
    s_win = cdiv(w, win_split) if window else 0
    # programmatic dependent launch (sm_90+) on the Gluon path where the call launches the rotation itself, right
    # before the history: the history loads its first steps, then waits for the rotation; each history program lets
    # the combine launch after its loop (the combine waits for the history grid's completion before it reads)
    pdl = bool(gluon and s_hist and rotate and device.type == "cuda" and cuda_major(device) >= 9)
    fused = bool(rotate and s_hist and s_win and fused_prologue(gluon))
    long_ = bool(gluon and s_hist and long_splits(df, n, s_hist))
    k8 = long_ and d == 128  # (int8 keys at D = 128 only: D = 256's long splits take fp16 keys, the long stages)
    # the int8 key path's query operands built once per (row, KV head) by the prologue's rotation programs, one per
    # plane, not by every history program; and the history programs' wait for them on counters those programs raise
    qpre = fused and k8
    pid_off = s_hist if gluon else 0
    s_after = s_win + int(sinks and window)  # the partials after the history's: window programs' and the sink's
    combine = (combine_shape(df, d, bh * m, s_hist, s_after, device, few) if window
               else CombineShape(merge_step(df, s_hist, s_win, few, d), min(d, 32), 4, 1, False))
    return DecodePlan(
        gluon=gluon, m_pad=m_pad, block_n=block_n, deferred=deferred, maxnreg=maxnreg,
        gluon_maxnreg=gp.maxnreg if gluon else 0,
        gluon_stages=(df.gluon_stages_long if long_ else df.gluon_stages) if gluon else 0, k8=k8,
        s_hist=s_hist, split_len=split_len, s_win=s_win, win_split=win_split,
        s_tot=max(s_hist + s_win, 1) + s_after - s_win,
        fused_prologue=fused, qpre=qpre, pdl=pdl, ready=qpre and pdl, tb=gluon_step // 16 if qpre else 2,
        pid_off=pid_off, split_programs=(s_hist if fused else s_hist + s_win) - pid_off,
        split_window=s_win > 0 and not fused,
        # D = 256, 64 query rows or the dequant loop's per-channel metadata: 8 warps (and 2 stages for D = 256) keep the
        # tiles in registers, except D = 256 on the deferred loop (<= 16 query rows): 4 warps; D = 512: 8 (spill
        # bounds: tests/kernels/test_compile_sm90.py)
        split_warps=(df.num_warps_xwide if d > 256 else df.num_warps_wide_deferred if (d > 128 and deferred)
                     else df.num_warps_wide if (d > 128 or m_pad >= 64 or group_size % (d // 4)) else df.num_warps),
        split_stages=df.num_stages_wide if d > 128 else df.num_stages,
        win_stages=df.gluon_win_stages if pid_off else 1,
        combine=combine, sw_block=pow2_at_least(s_after, 1) if combine.hoist else 1)


# ---- the retrieval heads' read (kernels/heads_triton.py)


class HeadsPlan(NamedTuple):
    """The heads' read grid: ``splits`` history programs per (row, coded head) of ``split_len`` slots each (a multiple
    of ``block_n``), one window program more; ``m_pad`` query rows per program (``tl.dot`` needs 16)."""

    splits: int
    split_len: int
    m_pad: int
    block_n: int


def heads_plan(pairs: int, n_hist: int, m: int, device: torch.device,
               defaults: HeadsDefaults = HEADS_DEFAULTS, d: int = 128) -> HeadsPlan:
    """The grid of the heads' read for ``pairs`` (row, coded head) pairs of at most ``n_hist`` history slots and
    ``m`` query rows each, head_dim ``d``: the INT2 kernel's wave model with the heads' defaults. Host code only
    (testable anywhere; a CUDA graph keeps it, being a function of the storage's capacity)."""
    df = defaults
    block_n = df.block_n_xwide if d > 256 else df.block_n
    s = 0 if n_hist <= 0 else wave_splits(n_hist, pairs, device_sms(device), block_n, df.min_split, df.max_waves,
                                          df.resident)
    split_len = cdiv(cdiv(n_hist, s), block_n) * block_n if s else 0
    return HeadsPlan(s, split_len, pow2_at_least(m, 16), block_n)
