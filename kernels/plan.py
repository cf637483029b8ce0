"""Launch planning: the split-K wave model and :func:`decode_plan`, every launch decision of one decode call (kernels,
grids, tiles, register caps, PDL) from its shapes and flags; the launchers only read the plan. Plain Python and torch
(no Triton import), so the cache can size its grid on machines without Triton. Re-exports :mod:`.settings`.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from .settings import (DEFAULTS, HEADS_DEFAULTS, DecodeDefaults, HeadsDefaults, cdiv, next_pow2,  # noqa: F401
                       last_contiguous, pow2_at_least, settle_cache_keys, triton_enabled, triton_importable)

# ---- the shapes the Triton kernels serve (the tests in tests/kernels parametrize over the same tuples)

# head_dims of the decode read and of the writes (also 32 there). 96 (Phi-3) is padded to 128 inside the kernels
# (tl.arange takes powers of two only), the padded channels masked (DP, D4P).
KERNEL_HEAD_DIMS = (64, 96, 128, 256, 512)
WRITE_HEAD_DIMS = (32, *KERNEL_HEAD_DIMS)


def group_fits(d: int, group_size: int) -> bool:
    """Whether the kernels take ``group_size`` channels per scale / zero at head_dim ``d``: a power-of-two divisor of
    ``d``, or a whole number of ``D/4``-channel planes (24, 48, 96 at ``d = 96``)."""
    g = group_size
    return g > 0 and d % g == 0 and ((g & (g - 1)) == 0 or g % (d // 4) == 0)


def plain_fits(d: int) -> bool:
    """Whether the kernels take 3-bit keys or a values' group of their own at head_dim ``d``: the split kernel's
    dequant loop and the one-token write kernel read and write them in the unpadded layout, at power-of-two head_dims
    (docs/kernels.md §3.11; ``OscarConfig.kernels_serve`` states the same rule for the cache)."""
    return d > 0 and d & (d - 1) == 0


_properties = functools.lru_cache(maxsize=None)(torch.cuda.get_device_properties)  # device index -> properties


def _cuda_properties(device: torch.device):
    """A CUDA device's properties (its index, or the current one), cached: a query costs ~10 us a call."""
    return _properties(device.index if device.index is not None else torch.cuda.current_device())


def cuda_major(device: torch.device) -> int:
    """Compute capability major of a CUDA device."""
    return _cuda_properties(device).major


def device_sms(device: torch.device) -> int:
    """SMs of a CUDA device; 4 elsewhere (the interpreter's stand-in)."""
    return _cuda_properties(device).multi_processor_count if device.type == "cuda" else 4


M_PAD_MIN = 16  # smallest query-row tile of the split kernel (tl.dot needs 16; 8 was slower: docs/kernels.md)


def resident_programs(defaults: DecodeDefaults, maxnreg: int | None) -> int:
    """Split-kernel programs one SM holds: ``65536 // (maxnreg * 32 * num_warps)`` under a register cap, else 2 (ptxas
    takes 238-255 registers for the default tile)."""
    return max(1, 65536 // (maxnreg * 32 * defaults.num_warps)) if maxnreg else 2


def wave_splits(n: int, bh: int, sms: int, block_n: int, min_split: int, max_waves: int, resident: int) -> int:
    """The wave model: ``bh * S`` programs on ``resident x SMs`` slots take ``ceil(bh * S / slots)`` waves of one
    split each. Returns the ``S`` of least ``waves x (blocks per split + 1/2)`` (smallest on ties), with at least
    ``min_split`` tokens per split and at most ``max_waves`` waves."""
    bh = max(bh, 1)
    s_max = max(1, min(cdiv(n, min_split), cdiv(n, block_n)))
    slots = resident * sms
    s_max = min(s_max, max(1, max_waves * slots // bh))
    # waves non-decreasing and blocks non-increasing in S: one candidate per wave count suffices, not a scan over S
    # (this runs on the host every decode step of every layer)
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
    """Split-K factor of the split kernel for ``bh`` (row, KV head) pairs of ``n`` history tokens. ``static``: the
    static cache's call, which runs without the register cap."""
    d = defaults or DEFAULTS
    resident = resident_programs(d, None if static else d.maxnreg)
    return wave_splits(n, bh, device_sms(device), d.block_n, d.min_split, d.max_waves, resident)


class GluonPlan(NamedTuple):
    """The Gluon history kernel's grid for one call."""

    block_n: int  # tokens per step (16 or 32)
    splits: int  # history splits per (row, KV head), from the wave model at the chosen residency
    maxnreg: int  # ptxas register cap


def long_splits(defaults: DecodeDefaults, n: int, s_hist: int) -> bool:
    """Splits of at least ``gluon_long_split`` tokens: the Gluon kernel then takes int8 key MMAs (whose setup pays
    back over a long split only) and ``gluon_stages_long``."""
    return n >= max(s_hist, 1) * defaults.gluon_long_split


def gluon_query_groups(m: int, d: int) -> int:
    """Gluon history programs per (row, KV head): 2 at D = 64 with an even 5-8 query rows (its logit tile holds <= 4
    rows), else 1."""
    return 2 if (d == 64 and 4 < m <= 8 and m % 2 == 0) else 1


def tokens_per_step(m: int, d: int) -> int:
    """Tokens per Gluon step: 32 (two sets of 16) where <= 4 query rows leave half the logit tile free at D = 128, and
    at D = 64; else 16 (D = 256 fills the registers at one set)."""
    return 32 if ((m <= 4 and d == 128) or d == 64) else 16


def gluon_plan(defaults: DecodeDefaults, tokens_per_step: int, n: int, bh: int, device: torch.device,
               head_dim: int = 128) -> GluonPlan:
    """The Gluon grid: the short-split residency and cap, or the long splits' where those splits are long;
    ``head_dim`` 256 has its own, 64 always the short splits' (no int8 keys)."""
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
    """``s``, or the power of two below it if at most ``slack * s`` fewer: the combine merges splits in power-of-two
    tiles (132 splits would take a tile of 256)."""
    p = 1 << max(s.bit_length() - 1, 0)
    return p if s > p and s - p <= slack * s else s


class CombineShape(NamedTuple):
    s_block: int  # split partials merged per step
    c_block: int  # output channels per un-rotation step
    warps: int
    parts: int  # programs per query row
    hoist: bool  # the window partials and R_V's first chunk loaded with the history partials


def merge_step(defaults: DecodeDefaults, s_hist: int, s_win: int, few: bool, d: int = 128) -> int:
    """Split partials the combine merges per step: a row's all (a power of two), capped by ``merge_block`` (``_few``
    under fewer rows than SMs, ``_xwide`` above D = 256)."""
    cap = defaults.merge_block_xwide if d > 256 else defaults.merge_block_few if few else defaults.merge_block
    return min(pow2_at_least(max(s_hist, s_win, 1), 1), cap)


def combine_shape(defaults: DecodeDefaults, d: int, rows: int, s_hist: int, s_win: int, device: torch.device,
                  few: bool) -> CombineShape:
    """The combine launch for ``rows`` (B x Hk x M) query rows. Few rows (< SMs): ``merge_out_parts`` programs a row;
    many: 4 warps; crowded (``merge_one_warp_rows`` a SM): one warp a row, 16-row R_V chunks, <= 16 splits a round."""
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


# ---- the decode op's launch plan (FlashInfer's plan(); decode_triton.py and paged_decode.py launch from it)


def gluon_pays(defaults: DecodeDefaults, bh: int, n: int) -> bool:
    """Whether the Gluon history kernel pays for its extra launch: ``bh * n >= gluon_min_work`` (docs/kernels.md)."""
    return bh * n >= defaults.gluon_min_work


def fused_prologue(gluon: bool) -> bool:
    """Whether the query rotation launches with the window programs (``_prologue_kernel``): on the Gluon path, whose
    window programs are a launch of their own anyway (tests patch this to run it under the interpreter)."""
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


def plan_variant(plan: DecodePlan) -> tuple:
    """What of ``plan`` the kernels compile for: its tiles, flags and which launches run, less the lengths and counts
    that reach them as unspecialized ints or grid sizes (a new variant compiles; oscar_hf.serving.warmup)."""
    return dataclasses.astuple(dataclasses.replace(
        plan, s_hist=plan.s_hist > 0, split_len=plan.split_len > 0, s_win=plan.s_win > 0, win_split=0, s_tot=0,
        pid_off=plan.pid_off > 0, split_programs=plan.split_programs > 0))


class DecodeShape(NamedTuple):
    """``b`` rows, ``hk`` KV heads, ``m`` query rows per KV head of head_dim ``d``, ``n`` INT2 history tokens (the
    capacity where the length is on the device), ``w`` window tokens."""

    b: int
    hk: int
    m: int
    d: int
    n: int
    group_size: int
    w: int


def decode_plan(shape: DecodeShape, device: torch.device, *, window: bool = True, static: bool = False,
                splits: int | None = None, rotate: bool = False, gluon_step: int = 0, page: int = 0,
                sinks: bool = False, softcap: bool = False, plain: bool = False,
                defaults: DecodeDefaults = DEFAULTS) -> DecodePlan:
    """The launch plan of one decode call of ``shape`` on ``device``; no tensor.

    window: False: the history's partials only. static: the length is on the device (``n_valid``); the grid follows
    from the capacity and ``splits`` so a CUDA graph stays valid. rotate: the op rotates the query itself.
    gluon_step: the Gluon kernel's tokens per step where it serves the call (0: not). page: entries per page of a
    paged history (0: contiguous). sinks: one more partial per row, the sink's logit (``m = s, l = 1, acc = 0``),
    merged like a window partial. softcap: the Gluon kernel has none, so the split kernel serves the history.
    plain: the split kernel's dequant loop serves the history (3-bit keys, values at a group of their own: the only
    loop that reads them, docs/kernels.md §3.11).
    """
    df, (b, hk, m, d, n, group_size, w) = defaults, shape
    bh = b * hk
    m_pad = pow2_at_least(m, M_PAD_MIN)
    # defaults tuned for D = 128, <= 16 query rows; larger tiles would spill registers elsewhere
    block_n = df.block_n if (d == 128 and m_pad <= 16) else df.block_n_xwide if d > 256 else df.block_n_other
    if page >= 16 and page & (page - 1) == 0:  # pages of a power of two: a block in one page, one table load a block
        block_n = min(block_n, page)
    # the deferred loop needs G a multiple of D/4 and <= 16 query rows ([BLOCK_N, M_PAD] tiles spill beyond)
    deferred = group_size % (d // 4) == 0 and m_pad <= 16 and not plain
    # the cap was measured for the contiguous deferred loop only; the static variant spills under it (test_compile_sm90)
    maxnreg = df.maxnreg if (not static and not page and deferred and d == 128) else None
    qg = gluon_query_groups(m, d)
    # D = 64 with 5-8 query rows (gpt-oss): two query groups (gluon_query_groups)
    gluon = gluon_step > 0 and not softcap and not plain and gluon_pays(df, bh, n) and (d != 64 or m <= 4 or qg > 1)
    if gluon:
        # the static cache's `splits` (sized for the split kernel) unused: the capacity alone fixes the Gluon grid
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
    # PDL (sm_90+) on the Gluon path after the call's own rotation: the history loads its first steps before waiting
    pdl = bool(gluon and s_hist and rotate and device.type == "cuda" and cuda_major(device) >= 9)
    fused = bool(rotate and s_hist and s_win and fused_prologue(gluon))
    long_ = bool(gluon and s_hist and long_splits(df, n, s_hist))
    k8 = long_ and d == 128  # (int8 keys at D = 128 only: D = 256's long splits take fp16 keys, the long stages)
    # the int8 key path's query operands built once by the prologue's rotation programs, not by every history program
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
        # warps that keep the tiles in registers (spill bounds: tests/kernels/test_compile_sm90.py)
        split_warps=(df.num_warps_xwide if d > 256 else df.num_warps_wide_deferred if (d > 128 and deferred)
                     else df.num_warps_wide if (d > 128 or m_pad >= 64 or group_size % (d // 4)) else df.num_warps),
        split_stages=df.num_stages_wide if d > 128 else df.num_stages,
        win_stages=df.gluon_win_stages if pid_off else 1,
        combine=combine, sw_block=pow2_at_least(s_after, 1) if combine.hoist else 1)


# ---- the retrieval heads' read (kernels/heads_triton.py)


class HeadsPlan(NamedTuple):
    """The heads' read grid: ``splits`` history programs of ``split_len`` slots per (row, coded head), plus one window
    program; ``m_pad`` query rows per program."""

    splits: int
    split_len: int
    m_pad: int
    block_n: int


def heads_plan(pairs: int, n_hist: int, m: int, device: torch.device,
               defaults: HeadsDefaults = HEADS_DEFAULTS, d: int = 128) -> HeadsPlan:
    """The heads' read grid for ``pairs`` (row, coded head) pairs of <= ``n_hist`` slots and ``m`` query rows: the
    wave model with the heads' defaults (a function of the capacity, so a CUDA graph keeps it)."""
    df = defaults
    block_n = df.block_n_xwide if d > 256 else df.block_n
    s = 0 if n_hist <= 0 else wave_splits(n_hist, pairs, device_sms(device), block_n, df.min_split, df.max_waves,
                                          df.resident)
    split_len = cdiv(cdiv(n_hist, s), block_n) * block_n if s else 0
    return HeadsPlan(s, split_len, pow2_at_least(m, 16), block_n)
