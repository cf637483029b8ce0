"""Compile the Gluon history kernel (``kernels/decode_gluon.py``) for Hopper (sm_90) without a GPU.

Run as a script with ``TRITON_INTERPRET`` unset (``test_compile_sm90.py`` does): compiles ``_hist_kernel`` with the
signature ``launch_history`` passes at the benchmark shape (``D = 128``, ``G = 64``, code rows of 32 bytes, bf16
metadata) for both token-set layouts (``TB = 2``: <= 4 query rows, ``TB = 1``: 5-8), both ways of removing the value
codes' offset (``GSUM``), each key path (``K8``: fp16 or int8 key MMAs) and the default pipelines (``STAGES``: of
short and of long splits; the long splits' int8-key kernel under ``CONFIG["gluon_maxnreg_long"]``), and, for ``GSUM
= 1``, the register-load loop (``STAGES = 0``, fp16 keys), under the default CONFIG otherwise (the split's first
loads before the query's: ``EARLY`` from ``CONFIG["gluon_early"]``, or ``$AOT_EARLY``; programmatic dependent launch
compiled in, ``PDL`` 2 with it, else 1; the int8 key path with its query operands from the prologue, ``QPRE`` from
``CONFIG["gluon_qpre"]`` or ``$AOT_QPRE``, and once without), and prints one JSON line each: registers, spilled
bytes, shared memory, the rounding instructions of the whole kernel (``frnd``) and the opcode counts of the hot loop
(the innermost loop that holds the tensor-core ops).

For experiments (not used by the test): ``AOT_STAGES=2,4`` compiles only those pipelines (TB = 2, GSUM, int8 keys),
``AOT_MAXNREG`` overrides the register cap, ``AOT_DUMP=prefix`` writes each case's hot loop SASS to a file,
``AOT_TIMED=1`` compiles the diagnostic timestamps in (``TIMED``).
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
    from oscar_hf.kernels.decode_triton import CONFIG, gluon_history_pdl

    ptrs = dict(Q="*fp32", KC="*u8", KS="*bf16", KZ="*bf16", VC="*u8", VS="*bf16", VZ="*bf16", START="*i32",
                QKOFF="*fp32", QP8="*i8", QPF="*fp32", READY="*i32")
    ints = "N M Hk S S_TOT split_len".split()
    strides = "sqb sqh sqm skb skh smkb smkh svb svh smvb smvh sob soh som".split()
    stages = int(CONFIG["gluon_stages"])
    # both key paths (fp16 / int8 key MMAs: CONFIG["gluon_k8"] picks one per call) with both pipelines (short and long
    # splits: CONFIG["gluon_stages"], ["gluon_stages_long"])
    pipes = sorted({stages, int(CONFIG.get("gluon_stages_long") or stages)})
    # int8 keys: the query operands from the prologue (QPRE, CONFIG["gluon_qpre"]; the rotating op) and, for one case,
    # built by the kernel itself (the static cache's op, which takes the rotated query)
    qpre = int(os.environ.get("AOT_QPRE", int(bool(CONFIG.get("gluon_qpre")))))
    cases = [(tb, gsum, st, k8, qpre * k8) for st in pipes for k8 in (0, 1) for gsum in (0, 1) for tb in (2, 1)]
    if qpre:
        cases += [(2, 1, pipes[-1], 1, 0)]
    if stages:
        cases += [(2, 1, 0, 0, 0), (1, 1, 0, 0, 0)]  # the register-load loop too (fp16 keys)
    early = int(os.environ.get("AOT_EARLY", CONFIG.get("gluon_early", 0)))
    if "AOT_STAGES" in os.environ:  # only these pipelines (e.g. "2,4"), default key path and offsets, TB = 2
        cases = [(2, 1, int(x), 1, qpre) for x in os.environ["AOT_STAGES"].split(",")]
    for tb, gsum, st, k8_, qp in cases:
        consts = {"NPTR": None, "TB": tb, "HAS_OFF": 1, "N_DEV": 0,
                  "STAGES": st, "SPLITK": int(CONFIG["gluon_splitk"]),
                  "L2PF": int(CONFIG["gluon_l2pf"]), "GSUM": gsum, "EARLY": early, "K8": k8_, "QPRE": qp,
                  # (programmatic dependent launch compiled in as the default CONFIG["pdl"] launches it -- 5 -> 4, the
                  # combine let go after the loop; at least 2, the prologue's wait; AOT_PDL: another)
                  "PDL": int(os.environ.get("AOT_PDL", max(2, gluon_history_pdl(int(CONFIG.get("pdl") or 0)))
                                            if early else 1)),
                  "TIMES": None, "TIMED": 0}
        # the prologue -> history counters (CONFIG["gluon_qflag"], with the prologue's operands and PDL 2)
        qflag = int(bool(qp) and consts["PDL"] >= 2 and int(os.environ.get("AOT_QFLAG", CONFIG.get("gluon_qflag") or 0)))
        consts["QFLAG"] = qflag
        if not qp:
            consts.update(QP8=None, QPF=None)
        if not qflag:
            consts["READY"] = None
        if os.environ.get("AOT_TIMED"):  # the diagnostic per-program timestamps compiled in
            consts["TIMED"] = 1
            del consts["TIMES"]
            ptrs["TIMES"] = "*i64"
        sig = {}
        for name in dg._hist_kernel.arg_names:
            if name in consts:
                sig[name] = "constexpr"
            elif name in ptrs or name in ("PM", "PL", "PACC"):
                sig[name] = ptrs.get(name, "*fp32")
            elif name == "qk_scale":
                sig[name] = "fp32"
            else:
                assert name in ints or name in strides, name
                sig[name] = "i32"
        # pointers 16-byte aligned and strides (but sqm, som) multiples of 16, as the JIT specializes them
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(dg._hist_kernel.arg_names)
                 if sig[n].startswith("*") or (n in strides and n not in ("sqm", "som")) or n == "split_len"}
        src = GluonASTSource(fn=dg._hist_kernel, signature=sig, constexprs=consts, attrs=attrs)
        opts = {"num_warps": 1}
        # the long splits' kernel (their pipeline and int8 keys) runs under its own cap (CONFIG["gluon_maxnreg_long"])
        long_ = st == int(CONFIG.get("gluon_stages_long") or -1) and k8_ and CONFIG.get("gluon_resident_long")
        cap = CONFIG.get("gluon_maxnreg_long") if long_ else CONFIG.get("gluon_maxnreg")
        if os.environ.get("AOT_MAXNREG") or cap:
            opts["maxnreg"] = int(os.environ.get("AOT_MAXNREG") or cap)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        regs, spill, sass = cubin_report(c.asm["cubin"], sass=True)
        op = lambda s: re.sub(r"^@!?U?P\w+\s+", "", s).split()[0]  # noqa: E731
        loop = collections.Counter(op(i) for i in _hot_loop(sass))
        if os.environ.get("AOT_DUMP"):  # the hot loop's SASS, one file a case (AOT_DUMP_ALL: the whole kernel's)
            with open(f"{os.environ['AOT_DUMP']}_tb{tb}_g{gsum}_s{st}_k{k8_}_q{qp}.sass", "w") as f:
                f.write(sass if os.environ.get("AOT_DUMP_ALL") else "\n".join(_hot_loop(sass)))
        print(json.dumps({"kernel": "gluon", "tb": tb, "gsum": gsum, "stages": st, "k8": k8_, "qpre": qp,
                          "long": bool(long_),
                          "regs": regs, "frnd": sum(1 for i in re.findall(r"\*/\s+(?:@!?U?P\w+\s+)?(\w+)", sass)
                                                    if i.startswith("FRND")),
                          "spill_bytes": spill,
                          "maxnreg": opts.get("maxnreg"), "loop": dict(loop)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
