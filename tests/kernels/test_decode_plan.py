"""The decode op's launch plan (``plan.decode_plan``): pure host code, so checked here on the CPU with a GPU's SM count
faked. The expected plans are what the launch code decided before the plan was split out of it (read off its
launches, recorded with the kernels stubbed); the launchers must follow the plan they build.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_utils import loose, setup_interpreter

INTERPRETED = setup_interpreter()  # before any kernel module is imported

from decode_cases import _dt, _window_case  # noqa: E402
from oscar_hf.kernels import plan  # noqa: E402
from oscar_hf.kernels.plan import DEFAULTS, CombineShape, DecodeShape, decode_plan  # noqa: E402

CUDA = torch.device("cuda", 0)  # (constructible without a GPU; the plan reads only its type and, faked, its SMs)
N128K, N32K = 131072 - 320, 32768 - 320  # history tokens beside the 320-token window
BIG = dict(hk=8, m=4, d=128, group_size=64, w=320)  # the benchmark's layer: 8 KV heads, GQA 4, D = 128, G = 64
GLUON = dict(gluon_step=32)  # the Gluon kernel serves the tensors (4 query rows: 32 tokens a step)
HIST_ON_GLUON = dict(gluon=True, block_n=32, maxnreg=None, split_programs=0, fused_prologue=True, qpre=True, pdl=True,
                     ready=True, gluon_maxnreg=255, gluon_stages=4, k8=True)

# case: (decode_plan's arguments, SMs, the plan's fields the old launch code decided)
CASES = {
    # the dynamic cache's eager call from the unrotated query (prologue -> Gluon history -> combine, PDL)
    "B=1/128K rotating": (dict(b=1, n=N128K, **BIG, rotate=True, **GLUON), 132, dict(
        HIST_ON_GLUON, s_hist=128, split_len=1024, s_win=5, win_split=64, s_tot=133,
        combine=CombineShape(128, 32, 4, 4, True), sw_block=8)),
    "B=1/128K rotating, H100": (dict(b=1, n=N128K, **BIG, rotate=True, **GLUON), 78, dict(
        HIST_ON_GLUON, s_hist=78, split_len=1696, s_win=5, win_split=64, s_tot=83)),
    "B=8/32K rotating": (dict(b=8, n=N32K, **BIG, rotate=True, **GLUON), 132, dict(
        HIST_ON_GLUON, s_hist=33, split_len=992, s_win=5, win_split=64, s_tot=38,
        combine=CombineShape(64, 64, 4, 1, True))),
    "B=32/32K rotating": (dict(b=32, n=N32K, **BIG, rotate=True, **GLUON), 132, dict(
        HIST_ON_GLUON, s_hist=4, split_len=8128, s_win=3, win_split=128, s_tot=7,
        combine=CombineShape(4, 16, 1, 1, True), sw_block=4)),
    # the static cache's op (device-side length, the grid from the capacity; the rotation outside: no PDL)
    "B=1/128K static": (dict(b=1, n=N128K, **BIG, static=True, **GLUON), 132, dict(
        gluon=True, block_n=32, s_hist=128, split_len=0, s_win=5, win_split=64, s_tot=133, fused_prologue=False,
        pdl=False, k8=True, gluon_stages=4, pid_off=128, split_programs=5, split_window=True, win_stages=2)),
    "B=8/32K static": (dict(b=8, n=N32K, **BIG, static=True, **GLUON), 132, dict(
        gluon=True, s_hist=33, split_len=0, s_win=5, win_split=64, s_tot=38, pdl=False, pid_off=33,
        split_programs=5, combine=CombineShape(64, 64, 4, 1, True))),
    "static, splits=16": (dict(b=2, n=4097, **BIG, static=True, splits=16), 132, dict(
        gluon=False, block_n=64, maxnreg=None, s_hist=16, split_len=0, s_win=3, win_split=128, s_tot=19,
        split_programs=19, combine=CombineShape(16, 32, 4, 4, True))),
    # the split kernel: no Gluon kernel for these tensors, or too little work for it
    "B=8/32K, no Gluon": (dict(b=8, n=N32K, **BIG, rotate=True), 132, dict(
        gluon=False, block_n=64, deferred=True, maxnreg=168, s_hist=6, split_len=5440, s_win=3, win_split=128,
        s_tot=9, fused_prologue=False, pdl=False, pid_off=0, split_programs=9, win_stages=1,
        combine=CombineShape(8, 64, 4, 1, True))),
    "B=2/4K rotating": (dict(b=2, n=4097, **BIG, rotate=True, **GLUON), 132, dict(
        gluon=False, block_n=64, maxnreg=168, s_hist=17, split_len=256, s_win=3, s_tot=20, fused_prologue=False,
        split_programs=20, combine=CombineShape(32, 32, 4, 4, True))),
    "B=2/4K history only": (dict(b=2, n=4097, **BIG, window=False), 132, dict(
        gluon=False, block_n=64, maxnreg=168, s_hist=17, split_len=256, s_win=0, s_tot=17, split_programs=17,
        split_window=False, combine=CombineShape(32, 32, 4, 1, False), sw_block=1)),
    "D=64": (dict(b=1, hk=2, m=4, n=300, d=64, group_size=32, w=33), 132, dict(
        block_n=64, deferred=True, maxnreg=None, s_hist=2, split_len=192, s_win=1, s_tot=3, split_warps=4,
        combine=CombineShape(2, 16, 4, 4, True))),
    "D=256": (dict(b=1, hk=4, m=4, n=5000, d=256, group_size=64, w=320), 132, dict(
        block_n=64, deferred=True, maxnreg=None, s_hist=20, split_len=256, s_win=3, s_tot=23, split_warps=4,
        split_stages=2, combine=CombineShape(32, 32, 8, 4, False))),
    # D = 256 on the Gluon kernel (16-token steps at every M): fp16 keys on long splits too (no int8 path, so no
    # prologue-built query operands or counters), the long splits' stages, 8 programs an SM under ptxas's own limit
    "D=256 Gemma 3 B=8/128K rotating": (dict(b=8, hk=8, m=2, n=N128K, d=256, group_size=64, w=320, rotate=True,
                                             gluon_step=16), 132, dict(
        gluon=True, block_n=16, maxnreg=None, gluon_maxnreg=255, gluon_stages=4, k8=False, s_hist=32, split_len=4096,
        s_win=5, fused_prologue=True, qpre=False, pdl=True, ready=False, split_programs=0)),
    "D=256 Qwen3-Next B=8/128K rotating": (dict(b=8, hk=2, m=8, n=N128K, d=256, group_size=64, w=320, rotate=True,
                                                gluon_step=16), 132, dict(
        gluon=True, block_n=16, gluon_maxnreg=255, gluon_stages=4, k8=False, s_hist=64, split_len=2048, qpre=False)),
    "D=256 B=8/32K static": (dict(b=8, hk=8, m=2, n=N32K, d=256, group_size=64, w=320, static=True, gluon_step=16), 132,
                             dict(gluon=True, block_n=16, k8=False, gluon_stages=4, s_hist=32, split_len=0, pdl=False,
                                  split_programs=5)),
    "M=32: dequant loop": (dict(b=2, hk=2, m=32, n=600, d=128, group_size=64, w=33), 132, dict(
        m_pad=32, block_n=64, deferred=False, maxnreg=None, s_hist=3, split_len=256, s_win=1, s_tot=4)),
    "paged, 16-token pages": (dict(b=8, n=N32K, **BIG, page=16), 132, dict(
        gluon=False, block_n=16, maxnreg=None, s_hist=4, split_len=8112, s_win=3, s_tot=7, split_programs=7,
        combine=CombineShape(4, 64, 4, 1, True))),
    "paged, 48-token pages": (dict(b=8, n=N32K, **BIG, page=48), 132, dict(block_n=64, s_hist=4, split_len=8128)),
    # soft-capping: the split kernel serves the history (the Gluon kernel does not cap) with its default tile
    "B=1/128K rotating, softcap": (dict(b=1, n=N128K, **BIG, rotate=True, **GLUON, softcap=True), 132, dict(
        gluon=False, block_n=64, deferred=True, maxnreg=168, fused_prologue=False, pdl=False, k8=False, pid_off=0,
        split_window=True, split_warps=4)),
    # head_dim 96 (Phi-3, 32 / 32 heads): whole planes per group take the deferred loop, G = 32 (groups across planes)
    # the dequant loop with 8 warps; the combine un-rotates R_V's rows in chunks of 32 (3 programs a row, not 4 of 24)
    "D=96, G=96": (dict(b=1, hk=32, m=1, n=32768, d=96, group_size=96, w=320), 132, dict(
        block_n=64, deferred=True, maxnreg=None, split_warps=4, combine=CombineShape(8, 32, 4, 3, True))),
    "D=96, G=32": (dict(b=8, hk=32, m=1, n=32768, d=96, group_size=32, w=320), 132, dict(
        block_n=64, deferred=False, maxnreg=None, split_warps=8, combine=CombineShape(4, 32, 4, 1, True))),
    # head_dim 512 (Gemma 4's full layers, 16 / 4 heads): 16-token blocks, 8 warps, merge tiles of 32 partials
    "D=512, G=128": (dict(b=1, hk=4, m=4, n=32768, d=512, group_size=128, w=320), 132, dict(
        block_n=16, deferred=True, maxnreg=None, split_warps=8, split_stages=2,
        combine=CombineShape(32, 32, 8, 4, False))),
    "D=512, G=64": (dict(b=8, hk=4, m=4, n=32768, d=512, group_size=64, w=320), 132, dict(
        block_n=16, deferred=False, split_warps=8, combine=CombineShape(32, 32, 8, 4, False))),
}


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device of ``sms`` SMs and compute capability 9 as the plan sees it."""
    def use(sms):
        monkeypatch.setattr(plan, "device_sms", lambda device: sms if device.type == "cuda" else 4)
        monkeypatch.setattr(plan, "cuda_major", lambda device: 9)
    return use


@pytest.mark.parametrize("case", list(CASES))
def test_plan_matches_the_launch_code_before_it(gpu, case):
    kw, sms, want = CASES[case]
    gpu(sms)
    kw = dict(kw)
    shape = DecodeShape(*(kw.pop(f) for f in ("b", "hk", "m", "d", "n", "group_size", "w")))
    p = decode_plan(shape, CUDA, **kw)
    assert {f: getattr(p, f) for f in want} == want


def test_plan_on_the_cpu():
    """Under the interpreter (4 SMs stand in, no combine choices for few rows) the split kernel serves everything."""
    p = decode_plan(DecodeShape(1, 2, 4, 64, 300, 32, 33), torch.device("cpu"), rotate=True, gluon_step=32)
    assert (p.gluon, p.s_hist, p.split_len, p.s_win, p.s_tot, p.pdl, p.fused_prologue) == (False, 2, 192, 1, 3, False,
                                                                                          False)
    assert p.combine == CombineShape(2, 64, 4, 1, False)


def test_plan_without_anything_to_read(gpu):
    """No history and no window: one empty partial for the combine, no other launch."""
    gpu(132)
    p = decode_plan(DecodeShape(2, 8, 4, 128, 0, 64, 0), CUDA, rotate=True, gluon_step=32,
                    defaults=replace(DEFAULTS, gluon_min_work=0))
    assert p.empty and p.s_tot == 1 and p.split_programs == 0 and not (p.pdl or p.fused_prologue or p.k8)


@pytest.mark.parametrize("n_valid", [None, 150])
@pytest.mark.parametrize("window", [True, False])
def test_launcher_follows_its_plan(monkeypatch, window, n_valid):
    """The launcher's split and combine launches take their grids and tiles from the plan it built (kernels recorded,
    not run)."""
    dt = _dt()
    plans, launches = [], []
    real_plan = dt.decode_plan
    monkeypatch.setattr(dt, "decode_plan", lambda *a, **kw: (plans.append(real_plan(*a, **kw)), plans[-1])[1])
    for name in ("_split_kernel", "_combine_kernel"):
        monkeypatch.setattr(dt, name, type("K", (), {"__getitem__": lambda self, grid, name=name: (
            lambda *a, **kw: launches.append((name, grid, kw)))})())
    args, _ = _window_case(2, 2, 4, 300, 37, 64, 32, seed=1)
    if not window:
        args = {k: args[k] for k in ("q_rot", "k", "v", "start", "key_mask", "qk_offset", "scaling", "group_size")}
    loose(dt.decode_attention_triton)(**args, n_valid=None if n_valid is None else torch.tensor(n_valid), splits=3)
    (p,) = plans
    (_, split_grid, split), (_, comb_grid, comb) = launches
    assert split_grid == (4, p.split_programs) and p.split_programs == p.s_hist + p.s_win
    assert (split["BLOCK_N"], split["DEFERRED"], split["M_PAD"], split["HAS_WIN"]) == (
        p.block_n, int(p.deferred), p.m_pad, p.split_window)
    assert (split["num_warps"], split["num_stages"], split.get("maxnreg")) == (p.split_warps, p.split_stages, p.maxnreg)
    assert comb_grid == (2 * 2 * 4 * p.combine.parts,)
    assert (comb["S_BLOCK"], comb["C_BLOCK"], comb["num_warps"]) == (p.combine.s_block, p.combine.c_block,
                                                                     p.combine.warps)
    assert p.s_hist == (3 if n_valid is not None else 2) and p.s_win == (1 if window else 0)


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("m", [1, 3, 4, 5])
def test_plan_head_dim_64_on_gluon_up_to_4_query_rows(gpu, m, static):
    """D = 64 (Llama-3.2-1B 32 / 8, SmolLM2 9 / 3 heads) goes to the Gluon kernel at M <= 4 (32 tokens a step: 16 code
    rows of two tokens; fp16 keys, the short splits' residency and cap at every split length, the long splits'
    stages), never at an odd M > 4 (no even split into query groups) even where the Gluon kernel would take the
    tensors (``gluon_step``)."""
    gpu(132)
    p = decode_plan(DecodeShape(8, 8, m, 64, N128K, 64, 320), CUDA, rotate=not static, static=static,
                    gluon_step=32 if m <= 4 else 16)
    if m <= 4:
        assert (p.gluon, p.block_n, p.maxnreg, p.gluon_maxnreg, p.gluon_stages, p.k8, p.qpre, p.ready) == (
            True, 32, None, DEFAULTS.gluon_maxnreg, DEFAULTS.gluon_stages_long, False, False, False)
        assert p.s_hist == 49 and p.split_len == (0 if static else 2688) and p.split_len % 2 == 0
        assert (p.pdl, p.fused_prologue, p.split_programs) == ((False, False, 5) if static else (True, True, 0))
    else:
        assert (p.gluon, p.block_n, p.gluon_maxnreg, p.pid_off) == (False, DEFAULTS.block_n_other, 0, 0)
        assert p.split_programs == p.s_hist + p.s_win
    # short splits (an odd history shorter than two min_split splits, at any work): the short splits' 2 stages
    p = decode_plan(DecodeShape(2, 8, min(m, 4), 64, 301, 64, 320), CUDA, rotate=True, gluon_step=32,
                    defaults=replace(DEFAULTS, gluon_min_work=0))
    assert p.gluon and (p.gluon_stages, p.gluon_maxnreg) == (DEFAULTS.gluon_stages, DEFAULTS.gluon_maxnreg)


def test_gluon_kernel_head_dim_64_steps():
    """The Gluon module (where Gluon imports) reads D = 64 at 32 tokens a step (each query group's <= 4 rows)."""
    glu = _dt()._gluon_module()
    if glu is None:
        pytest.skip("this Triton has no Gluon")
    assert glu.tokens_per_step(4, 64) == 32 and glu.tokens_per_step(3, 64) == 32 and glu.tokens_per_step(8, 64) == 32


@pytest.mark.parametrize("m,groups", [(4, 1), (5, 1), (6, 2), (8, 2), (10, 1)])
def test_plan_head_dim_64_query_groups(gpu, m, groups):
    """D = 64 with 5-8 query rows (gpt-oss 64 / 8) goes to the Gluon kernel in two query groups where the rows split
    evenly (5 rows and more than 8 stay on the split kernel); its wave model then counts two programs per (row, KV
    head), so the splits are those of twice the rows."""
    gpu(132)
    assert plan.gluon_query_groups(m, 64) == groups and plan.gluon_query_groups(m, 128) == 1
    p = decode_plan(DecodeShape(8, 8, m, 64, N128K, 64, 320), CUDA, rotate=True, gluon_step=32)
    assert p.gluon == (m <= 4 or groups == 2)
    if p.gluon:
        assert p.s_hist == plan.gluon_plan(DEFAULTS, 32, N128K, 8 * 8 * groups, CUDA, 64).splits
