"""The Triton kernels compile for Hopper (sm_90) and keep their registers: checked on any machine.

CI has no GPU, so the interpreter tests cannot catch what only the compiler rejects (layouts,
dtypes, constexpr misuse) or register spills. ``aot_sm90.py`` compiles every kernel variant the
host code launches with ``triton.compile`` for ``cuda:90`` (ptxas ships with triton) in a fresh
process without ``TRITON_INTERPRET``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")


def _ptxas_available() -> bool:
    base = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    return (base / "ptxas").exists() and (base / "cuobjdump").exists()


@pytest.mark.skipif(not _ptxas_available(), reason="triton without its bundled ptxas/cuobjdump")
def test_kernels_compile_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONSAFEPATH")}  # (the script imports its neighbours)
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("aot_sm90.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    kinds = {r["kernel"] for r in rows}
    assert kinds == {"split", "combine", "write", "rotate_query", "heads_split", "heads_combine", "append",
                     "paged_append"}, rows
    for r in rows:
        # at most a few words of stack frame; under the deferred loop's register cap (DEFAULTS.maxnreg) a few more; at
        # D = 256 on 4 warps (DEFAULTS.num_warps_wide_deferred) 136 bytes, which the H200 sweep found twice as fast as
        # 8 warps without spills (benchmarks/results/sweep_h200_d256.json)
        wide4 = "d=256" in r["case"] and "deferred" in r["case"]
        assert r["spill_bytes"] <= (160 if wide4 else 128 if r["maxnreg"] else 64), r
        assert r["smem"] <= 227 * 1024, r
    # the decode hot loop at the benchmark shape: room for >= 2 programs per SM, or the programs the cap promises
    # (the wave model of num_splits sizes the grid by them)
    from oscar_hf.kernels.plan import DEFAULTS, resident_programs

    for main in (r for r in rows if r["kernel"] == "split" and "window=True" in r["case"]
                 and r["num_warps"] == DEFAULTS.num_warps):  # (the wave model's residency is that of 4-warp programs)
        resident = resident_programs(DEFAULTS, main["maxnreg"])
        assert main["regs"] * 32 * main["num_warps"] * max(2, resident) <= 65536, main
    capped = [r for r in rows if r["maxnreg"]]
    assert capped and all("loop=deferred" in r["case"] and "d=128" in r["case"] for r in capped), capped
    # head_dims 96 and 512 compile in every kernel (the others: the cases above), soft-capping on both loops
    for d in (96, 512):
        for kind in ("split", "combine", "write", "rotate_query", "heads_split", "append", "paged_append"):
            assert any(r["kernel"] == kind and f"d={d} " in r["case"] + " " for r in rows), (d, kind)
    assert {r["case"].split(" loop=")[1] for r in rows if r["kernel"] == "split" and "softcap" in r["case"]} == {
        "deferred softcap=50.0", "dequant softcap=50.0"}
    # 3-bit keys and a values' group of their own, in the split kernel's dequant loop and the one-token write
    for kind in ("split", "append"):
        for what in ("key_bits=3", "gv="):
            assert any(r["kernel"] == kind and what in r["case"] for r in rows), (kind, what)


@pytest.mark.skipif(not _ptxas_available(), reason="triton without its bundled ptxas/cuobjdump")
def test_gluon_history_kernel_compiles_for_sm90_in_registers():
    """The Gluon history kernel (no interpreter exists for Gluon: this and the GPU tests are its checks on CI and on
    the GPU): it compiles for sm_90 at both token-set layouts and head_dims 128 / 256 / 64 (D = 64: code rows of two
    tokens), stays under its register cap
    with no spill inside the hot loop, and the hot loop (one full step) has the structure the kernel's docstring
    states -- mma.sync only, one movmatrix per 8x8 block of W, the step's codes and metadata copied to shared memory by
    cp.async (16-byte copies of the codes), and no thread writing shared memory (a layout conversion through shared
    memory would show as STS)."""
    pytest.importorskip("triton.experimental.gluon")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONSAFEPATH")}  # (the script imports its neighbours)
    env["TRITON_DEFAULT_FP_FUSION"] = env.get("TRITON_DEFAULT_FP_FUSION", "1")
    script = Path(__file__).with_name("aot_gluon_sm90.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from oscar_hf.kernels.plan import DEFAULTS

    rows = {(r["d"], r["tb"], r["stages"], r["k8"], r["qpre"], r["static"]): r
            for r in (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{"))}
    # short splits: fp16 keys, gluon_stages; long splits: int8 keys, gluon_stages_long, their query operands from the
    # prologue (the rotating op) or built by the kernel (the static cache's op); D = 256 and D = 64: fp16 keys at both
    # stages, and the static op's variant
    short, long_ = DEFAULTS.gluon_stages, DEFAULTS.gluon_stages_long
    assert set(rows) == ({(128, tb, st, k8, qp, k8 and not qp) for tb in (1, 2)
                          for st, k8, qp in ((short, 0, 0), (long_, 1, 1), (long_, 1, 0))}
                         | {(d, 1, st, 0, 0, static) for d in (256, 64)
                            for st, static in ((short, 0), (long_, 0), (long_, 1))})
    for (d, tb, stages, k8, qp, static), r in rows.items():
        nh = max(d // 128, 1)  # 32-byte halves of a code row (D = 64: one, of two tokens)
        ng = 1 if d == 64 else 2 * nh  # metadata groups (D = 64: one a token; a word holds two tokens' halves)
        # the int8 query operands' rounding (cvt.rni: FRND) only where the kernel builds them itself; with QPRE it
        # loads what the prologue built
        assert (r["frnd"] == 0) if qp else (r["frnd"] > 0 if k8 else True), r
        # spills only outside the loop (the setup's tiles while the query operands are built; <= 136 bytes measured,
        # Triton 3.9): the cap of 12 programs per SM was measured faster than 13-14 programs without them (long
        # splits: 8 programs an SM under ptxas's own limit, faster still; D = 256: 24-72 bytes under that limit)
        # D = 64 (168 registers, 12 programs an SM at every split length): 0 bytes at 2 stages, 24 at 4 (Triton 3.9)
        assert r["spill_bytes"] <= (32 if d == 64 else 256), r
        assert r["regs"] <= (r["maxnreg"] or 255), r
        # as many one-warp programs fit an SM's registers as the wave model of num_splits sizes the grid for
        resident = (DEFAULTS.gluon_resident_wide if d == 256 else DEFAULTS.gluon_resident_long if r["long"]
                    else DEFAULTS.gluon_resident)
        assert resident * 32 * -(-r["regs"] // 8) * 8 <= 65536, r
        loop = r["loop"]
        assert not any(op.startswith(("LDL", "STL", "STS", "GMMA", "WGMMA")) for op in loop), loop
        # one step (16 TB code rows, 4 NH 32-channel chunks): key MMAs 4 NH chunks x 2 TB k-tiles, value MMAs 4 NH
        # chunks x 2 m-tiles x TB k-tiles, and the codes' offset: one MMA against the ones tile per group (2 NH; D = 64:
        # one) and k-tile
        hmma = sum(n for op, n in loop.items() if op.startswith("HMMA"))
        imma = sum(n for op, n in loop.items() if op.startswith("IMMA"))
        if k8:  # key MMAs int8 m16n8k32: 4 planes x TB k-tiles x (hi, lo); one lop3 per key word and plane, no prmt
            assert imma == 8 * tb and hmma == 8 * tb + 2 * tb, (tb, loop)
            assert loop.get("PRMT", 0) == 8 * tb, loop  # the value codes' pairing only
        else:
            assert imma == 0 and hmma == nh * (8 * tb + 8 * tb) + ng * tb, (d, tb, loop)
        assert loop.get("MOVM.16.MT88", 0) == 2 * ng, loop  # two 8x8 blocks per group
        copies = sum(n for op, n in loop.items() if op.startswith("LDGSTS"))
        # [T, 8 NH] key words + [T, 8 NH] value words (T = 16 TB, 16 bytes a lane: TB NH copies each) + the metadata
        # words (D = 128: [4 TB, 16], one copy a lane; D = 256: [64, 2], 4 copies of 4 bytes a lane); one commit group
        # a step; the codes read back from shared memory
        assert copies == 2 * tb * nh + (1 if nh == 1 else 4) and loop.get("LDGDEPBAR", 0) == 1, loop
        assert loop.get("LDGSTS.E.BYPASS.128", 0) == 2 * tb * nh + (tb == 2), loop
        assert any(op.startswith("LDS") for op in loop) and any(op.startswith("BAR") for op in loop), loop
    # D = 64 reads the same 512 code bytes a step as D = 128 at TB = 1 (16 rows of 32 bytes: 32 tokens, not 16) and
    # spends no more instructions on them (measured 219-220 against 240: one metadata group, not two)
    per_step = {k: sum(r["loop"].values()) for k, r in rows.items() if k[1] == 1 and not k[3]}
    assert per_step[(64, 1, short, 0, 0, 0)] <= per_step[(128, 1, short, 0, 0, 0)], per_step
