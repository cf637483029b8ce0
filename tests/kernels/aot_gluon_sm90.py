"""Compile the Gluon history kernel (``kernels/decode_gluon.py``) for Hopper (sm_90) without a GPU.

Run as a script with ``TRITON_INTERPRET`` unset (``test_compile_sm90.py`` does): compiles ``_hist_kernel`` with the
signature ``launch_history`` passes at the benchmark shape (``D = 128``, ``G = 64``, code rows of 32 bytes, bf16
metadata) for both token-set layouts (``TB = 2``: <= 4 query rows, ``TB = 1``: 5-8) and the launches the defaults
make: short splits (fp16 key MMAs, ``DEFAULTS.gluon_stages``, under ``gluon_maxnreg``) and long splits (int8 key MMAs,
``gluon_stages_long``, under ``gluon_maxnreg_long``), the latter from the rotating op (the query operands from the
prologue, ``QPRE``, waiting on its counters, ``QFLAG``, under programmatic dependent launch) and from the static
cache's op (operands built by the kernel, the history length on the device); and ``D = 256`` (rows of two 32-byte
halves, ``NH = 2``: ``TB = 1``, fp16 keys at every split length, under ``gluon_maxnreg_wide``) with short and long
splits' stages and the static op's variant; and ``D = 64`` (32-byte rows of two tokens, ``TP = 2``: ``TB = 1``, fp16
keys, under ``gluon_maxnreg``) the same three; and the paged history of the serving pool (``PAGED``: each step's page
from the block table, pages of 256 tokens) from the rotating op at every head_dim, short and long splits; and D = 64
in two query groups (``QG = 2``, 5-8 query rows). Prints one JSON line each: registers,
spilled bytes, shared memory, the rounding instructions of the whole kernel (``frnd``) and the opcode counts of the hot
loop (the innermost loop that holds the tensor-core ops). ``AOT_DUMP=prefix`` writes each case's hot loop SASS to a
file (``AOT_DUMP_ALL=1``: the whole kernel's).
"""
from __future__ import annotations

import collections
import json
import os
import re
import sys

import triton
from aot_sm90 import cubin_report
from triton.backends.compiler import GPUTarget


def _hot_loop(sass: str):
    lines = []
    for ln in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", ln)
        if m:
            lines.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    for addr, ins in lines:
        t = re.search(r"0x([0-9a-f]+)", ins) if "BRA" in ins else None
        if t and int(t.group(1), 16) < addr:
            loops.append([i for a, i in lines if int(t.group(1), 16) <= a <= addr])
    with_mma = [body for body in loops if any("HMMA" in i for i in body)]
    return min(with_mma, key=len) if with_mma else []


def main():
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    from triton.experimental.gluon._runtime import GluonASTSource

    from oscar_hf.kernels import decode_gluon as dg
    from oscar_hf.kernels.plan import DEFAULTS

    ptrs = dict(Q="*fp32", KC="*u8", KS="*bf16", KZ="*bf16", VC="*u8", VS="*bf16", VZ="*bf16", START="*i32",
                QKOFF="*fp32", QP8="*i8", QPF="*fp32", READY="*i32", NPTR="*i64", BT="*i32")
    ints = "N M Hk S S_TOT split_len sbt cps mps".split()
    strides = "sqb sqh sqm skb skh smkb smkh svb svh smvb smvh sob soh som".split()
    short, long_ = DEFAULTS.gluon_stages, DEFAULTS.gluon_stages_long
    # (D, TB, STAGES, K8, QPRE, static): short splits (the rotating op), long splits from the rotating op and from the
    # static op; D = 256 the same without int8 keys
    cases = [(128, tb, st, k8, qp, k8 and not qp, 0) for tb in (2, 1)
             for st, k8, qp in ((short, 0, 0), (long_, 1, 1), (long_, 1, 0))]
    cases += [(d, 1, st, 0, 0, static, 0) for d in (256, 64) for st, static in ((short, 0), (long_, 0), (long_, 1))]
    # the paged history (the rotating op: PDL; per-row lengths in NPTR), short and long splits
    cases += [(128, tb, st, k8, k8, 0, 1) for tb in (2, 1) for st, k8 in ((short, 0), (long_, 1))]
    cases += [(d, 1, st, 0, 0, 0, 1) for d in (256, 64) for st in (short, long_)]
    cases = [c + (1,) for c in cases]
    # D = 64 in two query groups (6 or 8 rows): the rotating op and the static op
    cases += [(64, 1, st, 0, 0, static, 0, 2) for st, static in ((short, 0), (long_, 1))]
    for d, tb, st, k8_, qp, static, paged, qg in cases:
        tp = 2 if d == 64 else 1
        consts = {"TB": tb, "HAS_OFF": 1, "N_DEV": int(static), "STAGES": st, "PDL": int(not static), "K8": k8_,
                  "QPRE": qp, "QFLAG": qp, "NH": max(d // 128, 1), "TP": tp, "PAGED": paged,
                  "PR": 256 // tp if paged else 1, "QG": qg}
        if not paged:
            consts["BT"] = None
        if not static and not paged:
            consts["NPTR"] = None
        if not qp:
            consts.update(QP8=None, QPF=None, READY=None)
        sig = {}
        for name in dg._hist_kernel.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in ptrs or name in ("PM", "PL", "PACC"):
                sig[name] = ptrs.get(name, "*fp32") if not (paged and name == "NPTR") else "*i32"
            elif name == "qk_scale":
                sig[name] = "fp32"
            else:
                assert name in ints or name in strides, name
                sig[name] = "i32"
        # pointers 16-byte aligned and strides (but sqm, som) multiples of 16, as the JIT specializes them (the pool's
        # page strides too: 16-byte copies need them)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(dg._hist_kernel.arg_names)
                 if sig[n].startswith("*") or (n in strides and n not in ("sqm", "som"))
                 or n in ("split_len", "cps", "mps")}
        src = GluonASTSource(fn=dg._hist_kernel, signature=sig, constexprs=consts, attrs=attrs)
        # the long splits' kernel (their pipeline and int8 keys) runs under its own cap, D = 256 under its own
        cap = (DEFAULTS.gluon_maxnreg_wide if d == 256 else DEFAULTS.gluon_maxnreg_long if k8_
               else DEFAULTS.gluon_maxnreg)
        opts = {"num_warps": 1, "maxnreg": cap}
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        regs, spill, sass = cubin_report(c.asm["cubin"], sass=True)
        op = lambda s: re.sub(r"^@!?U?P\w+\s+", "", s).split()[0]  # noqa: E731
        loop = collections.Counter(op(i) for i in _hot_loop(sass))
        if os.environ.get("AOT_DUMP"):  # the hot loop's SASS, one file a case (AOT_DUMP_ALL: the whole kernel's)
            with open(f"{os.environ['AOT_DUMP']}_d{d}_tb{tb}_s{st}_k{k8_}_q{qp}_n{int(static)}_p{paged}_g{qg}.sass",
                      "w") as f:
                f.write(sass if os.environ.get("AOT_DUMP_ALL") else "\n".join(_hot_loop(sass)))
        print(json.dumps({"kernel": "gluon", "d": d, "tb": tb, "stages": st, "k8": k8_, "qpre": qp,
                          "static": int(static), "paged": paged, "groups": qg, "long": bool(k8_),
                          "regs": regs, "frnd": sum(1 for i in re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?(\w+)", sass)
                                                    if i.startswith("FRND")),
                          "spill_bytes": spill, "maxnreg": cap, "loop": dict(loop)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
