"""Instruction report of the decode split kernel's hot loop, compiled for sm_90 on any machine.

Compiles ``_split_kernel`` with the arguments the benchmark shape passes (Hq=32, Hk=8, D=128, G=64,
one decode query, BF16 window) for each inner-loop variant named on the command line, disassembles
it with the cuobjdump bundled with Triton, finds the hot loop (the innermost loop holding the history
K dot's wgmma) and prints its length and opcode histogram, per code (history codes one thread handles
per iteration).
A proxy for the per-code work, not a timing: the timings come from ``bench_kernels.py`` on a GPU.
Flags left out follow ``CONFIG``. The device runs Triton 3.6, whose code can differ from a newer local
Triton's (session 9: 3.6 did not pipeline a loop that 3.9 did); run this script with a Triton 3.6 install
(e.g. ``python -m venv --system-site-packages v && v/bin/pip install triton==3.6.0``) to see the device's SASS.

    python -P scripts/sass_report.py rowdot deferred [--top 25] [--dump DIR]
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "kernels"))

import torch  # noqa: E402
from aot_sm90 import Recorder, compile_call  # noqa: E402


def hot_loop(sass: str):
    """Instructions of the innermost loop that holds the tensor-core ops: the smallest span between a
    backward branch's target and the branch that contains a wgmma (the history K dot; the window loop has none)."""
    lines = []
    for ln in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            lines.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []  # the body of every backward branch
    for addr, ins in lines:
        t = re.search(r"0x([0-9a-f]+)", ins) if "BRA" in ins else None
        if t and int(t.group(1), 16) < addr:
            loops.append([x for x in lines if int(t.group(1), 16) <= x[0] <= addr])
    best = min((body for body in loops if any("HGMMA" in i for _, i in body)), key=len, default=None)
    if best is None:  # no wgmma (small tiles take mma.sync): the loop with the most tensor-core ops, then the shortest
        n_mma = lambda body: sum("MMA" in i for _, i in body)  # noqa: E731
        best = min((body for body in loops if n_mma(body)), key=lambda body: (-n_mma(body), len(body)), default=None)
    return best or []


def opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)  # predicate
    return ins.split()[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("loops", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--dump", default=None, help="write each variant's full SASS here")
    ap.add_argument("--block-n", type=int, default=None)
    ap.add_argument("--prefetch", type=int, default=0, help="CONFIG['prefetch']: L2 prefetch distance in blocks")
    ap.add_argument("--pair", type=int, choices=(0, 1), default=None,
                    help="CONFIG['pair_meta'] (one 4-byte metadata load per token); default: as CONFIG")
    ap.add_argument("--ahead", type=int, choices=(0, 1), default=None,
                    help="CONFIG['meta_ahead'] (metadata loaded one block ahead); default: as CONFIG")
    ap.add_argument("--m-pad", type=int, default=None, help="CONFIG['m_pad_min']")
    ap.add_argument("--num-warps", type=int, default=None, help="CONFIG['num_warps']")
    ap.add_argument("--num-stages", type=int, default=None, help="CONFIG['num_stages']")
    ap.add_argument("--asm", type=int, choices=(0, 1), default=None,
                    help="CONFIG['asm_codes'] (code extraction in inline PTX); default: as CONFIG")
    ap.add_argument("--maxnreg", type=int, default=None, help="CONFIG['maxnreg'] (ptxas register cap)")
    args = ap.parse_args()
    from oscar_hf.kernels import decode_triton as dt
    from oscar_hf.quant import quantize_rows

    split = Recorder(dt._split_kernel)
    dt._split_kernel, dt._combine_kernel = split, Recorder(dt._combine_kernel)
    g0 = torch.Generator().manual_seed(0)
    b, hk, m, n, d, g = 8, 8, 4, 8192, 128, 64
    q = torch.randn(b, hk, m, d, generator=g0)
    k = quantize_rows(torch.randn(b, hk, n, d, generator=g0), g)
    kw_ = torch.randn(b, hk, 320, d, generator=g0).bfloat16()
    for loop in args.loops:
        dt.CONFIG["loop"] = loop
        if args.m_pad:
            dt.CONFIG["m_pad_min"] = args.m_pad
        if args.block_n:
            dt.CONFIG["block_n"] = args.block_n
        for key in ("num_warps", "num_stages", "maxnreg"):
            if getattr(args, key):
                dt.CONFIG[key] = getattr(args, key)
        split.calls.clear()
        dt.decode_attention_triton(q, k, k, torch.zeros(b, dtype=torch.int64), None, torch.randn(b, hk, m, generator=g0),
                                   0.1, g, q.bfloat16(), kw_, kw_, None, torch.randn(hk, d, d, generator=g0),
                                   torch.randn(hk, d, generator=g0), torch.bfloat16)
        grid, a, kw = split.calls[0]
        pair = int(dt.CONFIG["pair_meta"] if args.pair is None else args.pair)
        asm = int(dt.CONFIG["asm_codes"] if args.asm is None else args.asm)
        gpu_kw = {"LOWP": 1, "PREFETCH": args.prefetch, "PAIR": pair, "ASM": asm,
                  **({} if args.ahead is None else {"AHEAD": args.ahead})}
        res = compile_call(split.fn, a, kw, gpu_kw, sass=True)
        sass = res["sass"]
        if args.dump:
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            Path(args.dump, f"split_{loop}.sass").write_text(sass)
        body = hot_loop(sass)
        bn = kw["BLOCK_N"]
        codes_per_thread = bn * d * 2 / (32 * kw.get("num_warps", 4))
        hist = collections.Counter(opcode(i) for _, i in body)
        print(f"== {loop}: prefetch={args.prefetch} pair={pair} asm={asm} BLOCK_N={bn} warps={kw.get('num_warps')} regs={res['regs']} spill={res['spill_bytes']} "
              f"smem={res['smem']}  loop body {len(body)} instructions, {len(body) / codes_per_thread:.2f} per code")
        for op, c in hist.most_common(args.top):
            print(f"   {op:<14}{c:5d}")


if __name__ == "__main__":
    main()
