"""Diagnostic (session 28, GPU only): does an L2-hot load queue behind a program's own streaming copies, and does it
if those copies go through the bulk-copy engine (TMA, ``cp.async.bulk``) instead of the SM's load path
(``cp.async``)?

Why: in the B=1 decode op every history program issues its first copies (~7.5 KB: three pipeline steps) and then
polls the prologue's counter and loads the rotated query's operands. Sessions 25-27 found that poll and those loads
return only after the program's early copies (entry -> end of the wait p10 1.3 us even where the counter is already
up; ``benchmarks/README_kernels.md``): fewer early copies end the wait sooner but the loop later. If the queue is the
SM's own load path (its outstanding-miss slots), copies issued by the bulk-copy engine would leave the poll free.

Each of ``SMs x 8`` one-warp programs (as the history kernel's single wave) copies its own ``--bytes`` of a cold
buffer into shared memory, then polls a counter that is already set (``ld.acquire.gpu``, in L2), then loads 16 bytes
a lane of a hot operand buffer, then waits for its copies. ``%globaltimer`` at entry, after issuing the copies, after
the poll, after the operand load and once the copies have landed. Modes: ``none`` (no copies), ``lsu`` (``cp.async.cg``
16 bytes a lane, as the history kernel), ``bulk512`` / ``bulkbig`` (``cp.async.bulk`` by lane 0 into an mbarrier: 512-byte
pieces, or three pieces as three steps). The copied bytes are checked (one word a lane read back from shared memory).

    python3 scripts/probe_copy_queue.py --out probe_copy_queue.json

Result (session 28, H100 and H200, ``benchmarks/README_kernels.md``): with ``cp.async`` the poll and the load come back
with the copies; with ``cp.async.bulk`` 0.1-0.45 us sooner at the history's 7680 bytes, the hot bytes riding the SM's
intake of the stream either way.
"""
import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_kernels as bk  # noqa: E402

MODES = ("none", "lsu", "bulk512", "bulkbig")


def probe_asm(mode: str, nbytes: int) -> str:
    """One PTX block per lane. Outputs $0..$4: stamps at entry, after the copies' issue, after the poll, after the
    operand load, after the copies landed (u64); $5: the word the lane reads back at shared offset 16 lane; $6: %smid.
    Inputs: $7 the program's source bytes, $8 the counter, $9 the operand buffer."""
    s = ("{ .reg .u64 g, h, o, lo; .reg .u32 sb, sl, b, l, v, w0, w1, w2, w3; .reg .b64 st; .reg .pred p, p0; "
         f".shared .align 128 .b8 buf${{:uid}}[{nbytes}]; .shared .align 8 .b64 bar${{:uid}}; "
         "mov.u64 g, $7; mov.u64 h, $8; mov.u64 o, $9; mov.u32 sb, buf${:uid}; mov.u32 b, bar${:uid}; "
         "mov.u32 l, %laneid; mov.u32 $6, %smid; setp.eq.u32 p0, l, 0; "
         "shl.b32 v, l, 4; add.u32 sl, sb, v; cvt.u64.u32 lo, v; "
         "mov.u64 $0, %globaltimer; ")
    if mode == "lsu":  # 16 bytes a lane a copy: the warp moves 512 bytes an instruction
        s += "add.u64 g, g, lo; "
        s += " ".join(f"cp.async.cg.shared.global [sl+{512 * k}], [g+{512 * k}], 16;" for k in range(nbytes // 512))
        s += " cp.async.commit_group; "
    elif mode.startswith("bulk"):
        piece = 512 if mode == "bulk512" else nbytes // 3
        s += ("@p0 mbarrier.init.shared::cta.b64 [b], 1; fence.mbarrier_init.release.cluster; bar.warp.sync -1; "
              f"@p0 mbarrier.arrive.expect_tx.shared::cta.b64 st, [b], {nbytes}; ")
        s += " ".join(f"@p0 cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [sb+{piece * k}], "
                      f"[g+{piece * k}], {piece}, [b];" for k in range(nbytes // piece))
        s += " "
    s += ("mov.u64 $1, %globaltimer; "
          "POLL${:uid}: ld.acquire.gpu.global.u32 v, [h]; setp.eq.u32 p, v, 0; @p bra POLL${:uid}; "
          "mov.u64 $2, %globaltimer; add.u64 o, o, lo; ld.global.v4.u32 {w0, w1, w2, w3}, [o]; "
          "add.u32 w0, w0, w3; setp.eq.u32 p, w0, 0x7fffffff; @p bra POLL${:uid}; "  # (never: waits for the load)
          "mov.u64 $3, %globaltimer; ")
    if mode == "lsu":
        s += "cp.async.wait_all; bar.warp.sync -1; "
    elif mode.startswith("bulk"):
        s += "WAIT${:uid}: mbarrier.try_wait.parity.shared::cta.b64 p, [b], 0; @!p bra WAIT${:uid}; "
    s += "mov.u64 $4, %globaltimer; ld.shared.u32 $5, [sl]; }"
    return s


@triton.jit
def _probe(SRC, FLAG, OPS, TIMES, WORDS, NBYTES: tl.constexpr, ASM: tl.constexpr):
    pid = tl.program_id(0)
    i = tl.arange(0, 32)
    src = (SRC + pid.to(tl.int64) * (NBYTES // 4) + i * 0).to(tl.int64, bitcast=True)
    t0, t1, t2, t3, t4, w, sm = tl.inline_asm_elementwise(
        ASM, "=l,=l,=l,=l,=l,=r,=r,l,l,l",
        [src, (FLAG + i * 0).to(tl.int64, bitcast=True), (OPS + i * 0).to(tl.int64, bitcast=True)],
        dtype=(tl.int64, tl.int64, tl.int64, tl.int64, tl.int64, tl.int32, tl.int32), is_pure=False, pack=1)
    row = TIMES + pid * 6
    first = i == 0
    tl.store(row + i * 0, t0, mask=first)
    tl.store(row + 1 + i * 0, t1, mask=first)
    tl.store(row + 2 + i * 0, t2, mask=first)
    tl.store(row + 3 + i * 0, t3, mask=first)
    tl.store(row + 4 + i * 0, t4, mask=first)
    tl.store(row + 5 + i * 0, sm.to(tl.int64), mask=first)
    tl.store(WORDS + pid * 32 + i, w)


def _pct(x, qs=(10, 50, 90)):
    x = x.double().sort().values
    return {f"p{q}": round(float(x[min(len(x) - 1, len(x) * q // 100)]) / 1e3, 3) for q in qs} | {
        "max": round(float(x[-1]) / 1e3, 3)}


def run_mode(mode, nbytes, n, iters):
    src = torch.randint(-2 ** 31, 2 ** 31 - 1, (n * nbytes // 4,), device="cuda", dtype=torch.int32)
    flag = torch.zeros(64, device="cuda", dtype=torch.int32)
    ops = torch.zeros(1024, device="cuda", dtype=torch.int32)
    times = torch.zeros(n, 6, device="cuda", dtype=torch.int64)
    words = torch.zeros(n, 32, device="cuda", dtype=torch.int32)
    want = src.view(n, nbytes // 4)[:, 0:128:4]  # (lane l reads the word at byte 16 l of its program's bytes)
    asm = probe_asm(mode, nbytes)
    rows = []
    ok = True
    for it in range(iters + 1):
        bk.flush_l2()
        flag.fill_(1)  # (the counter and the operands in L2, as the prologue leaves them)
        ops.fill_(3)
        words.zero_()
        _probe[(n,)](src, flag, ops, times, words, NBYTES=nbytes, ASM=asm, num_warps=1)
        torch.cuda.synchronize()
        if mode != "none":
            ok &= bool(torch.equal(words, want))
        if it:  # (the first one compiles)
            rows.append(times.clone())
    t = torch.cat(rows)
    start = torch.cat([r[:, 0] - r[:, 0].min() for r in rows])
    span = torch.tensor([float(r[:, 4].max() - r[:, 0].min()) for r in rows])
    sms = rows[-1][:, 5]
    res = {"mode": mode, "bytes": nbytes, "programs": n, "copied_right": ok if mode != "none" else None,
           "sms_used": int(sms.unique().numel()), "max_programs_an_sm": int(torch.bincount(sms).max()),
           "entry_us": _pct(start), "issue_us": _pct(t[:, 1] - t[:, 0]), "poll_us": _pct(t[:, 2] - t[:, 1]),
           "operands_us": _pct(t[:, 3] - t[:, 2]),
           "entry_to_operands_us": _pct(t[:, 3] - t[:, 0]), "copies_landed_us": _pct(t[:, 4] - t[:, 0]),
           "span_us_p50": round(float(span.median()) / 1e3, 3),
           "gbps_p50": round(n * nbytes / float(span.median()), 1)}
    print(mode, nbytes, {k: v for k, v in res.items() if k not in ("mode", "bytes")}, flush=True)
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="probe_copy_queue.json")
    ap.add_argument("--bytes", default="3072,7680,15360", help="bytes a program copies (multiples of 1536), comma-separated")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--iters", type=int, default=10)
    bk.add_flush_arg(ap)
    args = ap.parse_args()
    sizes = [int(b) for b in args.bytes.split(",")]
    if any(b <= 0 or b % 1536 for b in sizes):  # (512-byte warp copies; three bulk pieces of 16-byte multiples)
        ap.error(f"--bytes: each a positive multiple of 1536, got {args.bytes}")
    bad = set(args.modes.split(",")) - set(MODES)
    if bad:
        ap.error(f"--modes: unknown {sorted(bad)}, choose from {MODES}")
    bk.FLUSH_MODE = args.flush
    bk.FLUSH = torch.empty(256 << 20, device="cuda", dtype=torch.uint8)
    n = 8 * torch.cuda.get_device_properties(0).multi_processor_count
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "command": " ".join(sys.argv), "rows": []}
    for nbytes in sizes:
        for mode in args.modes.split(","):
            res["rows"].append(run_mode(mode, nbytes, n, args.iters))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
