"""Compile the Triton kernels for Hopper (sm_90) without a GPU, with the arguments real calls pass.

Run as a script in a fresh process with ``TRITON_INTERPRET`` unset (``test_compile_sm90.py`` does):
the host code of each kernel runs on small CPU tensors with the launches recorded instead of
executed; each recorded launch is then compiled by ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``
(ptxas ships with triton) and its resource usage read back with cuobjdump. Prints one JSON line per
kernel variant: name, registers, spilled (local) bytes, shared memory.
"""
from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget

_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "u8",
       torch.int64: "i64", torch.int32: "i32", torch.bool: "i1"}


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args, **kw)`` is recorded, not run."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((grid, args, kw))


def cubin_report(cubin: bytes, sass: bool = False):
    """(registers, spilled local + stack bytes, SASS text or None) of a compiled kernel, read with the cuobjdump
    bundled with Triton."""
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        text = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout if sass else None
    regs = int(re.search(r"REG:(\d+)", res).group(1))
    local = int(re.search(r"LOCAL:(\d+)", res).group(1)) + int(re.search(r"STACK:(\d+)", res).group(1))
    return regs, local, text


def compile_call(fn, args, kw, cuda_kw, sass=False):
    """Compile one recorded launch for sm_90; its resource usage (and, with ``sass``, the SASS text
    under ``"sass"``)."""
    kw = {**kw, **{k: v for k, v in cuda_kw.items() if k in fn.arg_names}}
    vals = {k: p.default for k, p in inspect.signature(fn.fn).parameters.items() if p.default is not p.empty}
    vals.update(zip(fn.arg_names, args))
    vals.update({k: v for k, v in kw.items() if k in fn.arg_names})
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        v = vals[name]
        if fn.params[i].is_constexpr or v is None or isinstance(v, str):
            sig[name], consts[name] = "constexpr", v
        elif isinstance(v, torch.Tensor):  # device allocations are 16-byte aligned, like the JIT assumes
            sig[name], attrs[(i,)] = "*" + _TY[v.dtype], [["tt.divisibility", 16]]
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            if v == 1:  # the JIT specializes integers equal to 1
                sig[name], consts[name] = "constexpr", 1
            else:
                sig[name] = "i32" if abs(v) < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{name}: {type(v)}")
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    opts = {"num_warps": kw.get("num_warps", 4), "num_stages": kw.get("num_stages", 3)}
    if kw.get("maxnreg"):
        opts["maxnreg"] = kw["maxnreg"]
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    regs, local, text = cubin_report(c.asm["cubin"], sass)
    out = {"regs": regs, "spill_bytes": local, "smem": c.metadata.shared, "num_warps": opts["num_warps"],
           "maxnreg": opts.get("maxnreg")}
    return {**out, "sass": text} if sass else out


def main():
    assert os.environ.get("TRITON_INTERPRET", "0") != "1", "run without TRITON_INTERPRET"
    from kernel_utils import CodedSlots, heads_loose, loose, paged_write, ring_write  # (the launchers take the bundles)

    from oscar_hf.kernels import append_triton as at
    from oscar_hf.kernels import decode_triton as dt
    from oscar_hf.kernels import heads_triton as ht
    from oscar_hf.kernels import query_triton as qt
    from oscar_hf.kernels import write_triton as wt
    from oscar_hf.kernels.plan import DEFAULTS, HEADS_DEFAULTS
    from oscar_hf.quant import QuantizedRows, quantize_rows

    # the launchers' module-level names of the kernels, recorded instead of run
    split, comb, write = Recorder(dt._split_kernel), Recorder(dt._combine_kernel), Recorder(wt._rotate_quantize_kernel)
    dt._split_kernel, dt._combine_kernel, wt._rotate_quantize_kernel = split, comb, write
    rotq = Recorder(qt._rotate_query_kernel)
    qt._rotate_query_kernel = rotq
    hsplit, hcomb = Recorder(ht._heads_split_kernel), Recorder(ht._heads_combine_kernel)
    ht._heads_split_kernel, ht._heads_combine_kernel = hsplit, hcomb
    append = Recorder(at._append_token_kernel)  # (the contiguous and the paged write: PAGED tells them apart)
    at._append_token_kernel = append
    g0 = torch.Generator().manual_seed(0)
    labels = []

    def attn(b, hk, m, n, d, g, window, softcap=None, kbits=2, gv=None):
        q = torch.randn(b, hk, m, d, generator=g0)
        k = quantize_rows(torch.randn(b, hk, n, d, generator=g0), g, bits=kbits)
        v = quantize_rows(torch.randn(b, hk, n, d, generator=g0), gv or g)
        start = torch.zeros(b, dtype=torch.int64)
        off = torch.randn(b, hk, m, generator=g0)
        if window:
            w = 320
            kw_ = torch.randn(b, hk, w, d, generator=g0).bfloat16()
            loose(dt.decode_attention_triton)(q, k, v, start, None, off, 0.1, g, q.bfloat16(), kw_, kw_, None,
                                       torch.randn(hk, d, d, generator=g0), torch.randn(hk, d, generator=g0),
                                       torch.bfloat16, softcap=softcap)
        else:
            mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
            dt.history_partial_triton(q, k, v, start, mask, off, 0.1, g)
        plain = kbits == 3 or gv not in (None, g)  # (3-bit keys, a values' group of their own: the dequant loop)
        loop = "deferred" if (g % (d // 4) == 0 and m <= 16 and not plain) else "dequant"
        cap = f" softcap={softcap}" if softcap else ""
        own = (f" key_bits={kbits}" if kbits != 2 else "") + (f" gv={gv}" if gv not in (None, g) else "")
        labels.append(f"attn d={d} g={g} m={m} window={window} loop={loop}{cap}{own}")

    attn(1, 8, 4, 8192, 128, 64, True)  # the benchmark's shape, full decode op (deferred loop)
    attn(1, 2, 4, 4096, 64, 64, False)  # deferred, 4 planes per group
    attn(1, 8, 4, 8192, 128, 128, False)  # deferred, G = D
    attn(1, 2, 8, 4096, 64, 32, False)  # deferred, 2 planes per group
    attn(1, 2, 32, 4096, 128, 64, False)  # M = 32 (8 warps): the dequant loop serves
    attn(1, 2, 4, 4096, 256, 32, False)  # D = 256, G < D/4: dequant
    attn(1, 8, 2, 8192, 256, 64, True)  # D = 256, G = D/4 (Gemma 3's shape at the default group): deferred, 4 warps
    attn(1, 8, 8, 8192, 64, 64, True)  # D = 64 (gpt-oss's shape, GQA 8): deferred
    # the static cache's call: device-side history length, fixed splits, a bool window mask
    q = torch.randn(2, 8, 4, 128, generator=g0)
    k = v = quantize_rows(torch.randn(2, 8, 4097, 128, generator=g0), 64)
    kw_ = torch.randn(2, 8, 321, 128, generator=g0).bfloat16()
    loose(dt.decode_attention_triton)(q, k, v, torch.zeros(2, dtype=torch.int64), None, None, 0.1, 64, q.bfloat16(), kw_, kw_,
                               torch.ones(2, 1, 1, 321, dtype=torch.bool), torch.randn(8, 128, 128, generator=g0), None,
                               torch.bfloat16, n_valid=torch.tensor(3000), splits=16)
    labels.append("attn d=128 g=64 m=4 window=True loop=deferred static (n_valid)")
    # head_dims 96 (Phi-3, 32 / 32 heads: groups across planes -> the dequant loop's per-channel metadata, 8 warps;
    # whole planes -> deferred) and 512 (Gemma 4's full layers, 16 / 4 heads: 16-token blocks, 8 warps); soft-capped
    # logits (Gemma 2) on both loops
    wide = len(labels)
    attn(1, 32, 1, 8192, 96, 32, True)
    attn(1, 32, 1, 8192, 96, 96, True)
    attn(1, 4, 4, 8192, 512, 64, True)
    attn(1, 4, 4, 8192, 512, 128, True)
    attn(1, 8, 4, 8192, 128, 64, True, softcap=50.0)
    attn(1, 32, 1, 8192, 96, 32, True, softcap=50.0)
    # 3-bit keys (their high bits' plane) and values at a group of their own: the dequant loop (Gemma-3-270M's
    # candidate: keys at 32, values at 128; keys at D/2 at D = 128; values apart alone)
    attn(1, 1, 4, 8192, 256, 32, True, kbits=3, gv=128)
    attn(1, 8, 4, 8192, 128, 64, True, kbits=3)
    attn(2, 8, 4, 8192, 128, 32, False, gv=64)
    # write path: tile heights 128 (T=100 and bulk, T=1000) and 16 (one-row demotion) at D=128
    for d, g, meta, t in ((128, 64, torch.bfloat16, 100), (128, 64, torch.bfloat16, 1000), (128, 64, torch.bfloat16, 1),
                          (64, 32, torch.float16, 100), (256, 128, torch.bfloat16, 100),
                          (96, 32, torch.bfloat16, 1000), (96, 96, torch.float32, 1), (512, 64, torch.bfloat16, 100)):
        x = torch.randn(1, 2, t, d, generator=g0).bfloat16()
        wt.rotate_quantize_triton(x, torch.randn(2, d, d, generator=g0), torch.randn(2, d, generator=g0), 0.95, g, meta)
    # the decode step's query prologue: GQA 4 at D = 128 with offsets, MHA at D = 256 without
    qt.rotate_query_triton(torch.randn(2, 8, 4, 128, generator=g0), torch.randn(8, 128, 128, generator=g0),
                           torch.randn(8, 128, generator=g0))
    qt.rotate_query_triton(torch.randn(1, 2, 1, 256, generator=g0), torch.randn(2, 256, 256, generator=g0), None)
    for d in (96, 512):  # 3 column blocks of a padded query; the product K-blocked
        qt.rotate_query_triton(torch.randn(2, 4, 4, d, generator=g0), torch.randn(4, d, d, generator=g0),
                               torch.randn(4, d, generator=g0))
    # the retrieval heads' read at the benchmark shape (B = 8, 2 coded heads of 128, GQA 4, a 385-entry window), every
    # stored form, the history bound on the device (the compiled step) and on the host (eager)
    from oscar_hf.quant import pack_int4, quantize_minmax

    heads_labels = []
    for bits in (8, 4, 16):
        for hi in (torch.tensor(3000), 3000):
            x = torch.randn(8, 2, 4096, 128, generator=g0).bfloat16()
            qm = quantize_minmax(x, bits, torch.bfloat16) if bits != 16 else None
            st = (x,) if bits == 16 else ((pack_int4(qm.codes) if bits == 4 else qm.codes), qm.scale, qm.zero)
            wk = torch.randn(8, 8, 385, 128, generator=g0).bfloat16()
            heads_loose(ht.heads_decode_triton)(
                torch.randn(8, 8, 4, 128, generator=g0).bfloat16(), torch.tensor([1, 5]), st, st, bits,
                torch.zeros(8, dtype=torch.int64), hi, wk, wk, torch.ones(8, 385, dtype=torch.bool), 0.1,
                torch.bfloat16)
            heads_labels.append(f"heads bits={bits} hi_dev={isinstance(hi, torch.Tensor)}")
    # the serving store's window pool read in place by slot (HAS_WSLOT)
    from oscar_hf.kernels.kv import Window

    x = torch.randn(8, 2, 4096, 128, generator=g0).bfloat16()
    qm = quantize_minmax(x, 8, torch.bfloat16)
    wk = torch.randn(12, 8, 385, 128, generator=g0).bfloat16()
    ht.heads_decode_triton(torch.randn(8, 8, 4, 128, generator=g0).bfloat16(), torch.tensor([1, 5]),
                           ((qm.codes, qm.scale, qm.zero),) * 2, 8, (torch.zeros(8, dtype=torch.int64), torch.tensor(3000)),
                           Window(wk, wk, torch.ones(8, 385, dtype=torch.bool), torch.arange(8) + 2), 0.1, torch.bfloat16)
    heads_labels.append("heads bits=8 hi_dev=True window_slots=True")
    # head_dims 96 (planes padded) and 512 (32-slot blocks, 2 stages), and soft-capped logits
    for d, bits, cap in ((96, 8, None), (96, 4, None), (96, 16, None), (512, 8, None), (512, 4, None), (512, 16, None),
                         (128, 8, 50.0)):
        x = torch.randn(8, 2, 4096, d, generator=g0).bfloat16()
        qm = quantize_minmax(x, bits, torch.bfloat16) if bits != 16 else None
        st = (x,) if bits == 16 else ((pack_int4(qm.codes) if bits == 4 else qm.codes), qm.scale, qm.zero)
        wk = torch.randn(8, 8, 385, d, generator=g0).bfloat16()
        heads_loose(ht.heads_decode_triton)(
            torch.randn(8, 8, 4, d, generator=g0).bfloat16(), torch.tensor([1, 5]), st, st, bits,
            torch.zeros(8, dtype=torch.int64), torch.tensor(3000), wk, wk, torch.ones(8, 385, dtype=torch.bool), 0.1,
            torch.bfloat16, softcap=cap)
        heads_labels.append(f"heads d={d} bits={bits} hi_dev=True" + (f" softcap={cap}" if cap else ""))
    # the decode step's write (one program per row and KV head): D = 128 with and without a retrieval head coded at 8
    # bits, D = 96 (plane-padded; INT4 halves), D = 512 (8 warps; 16-bit heads)
    append_labels = []
    for d, g, heads, bits in ((128, 64, None, None), (128, 64, [1, -1, 0, 2], 8), (96, 32, [1, -1, 0, 2], 4),
                              (512, 64, [1, -1, 0, 2], 16)):
        b, hk, n = 2, 4, 40
        hq = hk if heads is None else sum(h >= 0 for h in heads)
        win = torch.randn(b, hk, 4 + 17, d, generator=g0).bfloat16()

        def hist():
            meta = torch.zeros(b, hq, n, d // g).bfloat16()
            return QuantizedRows(torch.zeros(b, hq, n, d // 4, dtype=torch.uint8), meta, meta.clone())

        coded = None
        if bits:
            p = hk - hq

            def store():
                if bits == 16:
                    return (torch.zeros(b, p, n, d).bfloat16(),)
                return (torch.zeros(b, p, n, d * bits // 8, dtype=torch.uint8), torch.zeros(b, p, n, 1).bfloat16(),
                        torch.zeros(b, p, n, 1).bfloat16())

            coded_of = torch.full((hk,), -1, dtype=torch.long)
            coded_of[[i for i in range(hk) if heads[i] < 0]] = torch.arange(p)
            coded = CodedSlots(store(), store(), coded_of, bits)
        new = torch.randn(b, hk, 1, d, generator=g0).bfloat16()
        ring_write(at.append_token_triton)(new, new, win, win.clone(), hist(), hist(), torch.tensor(30), torch.tensor([0, 1]),
                               None if heads is None else torch.tensor(heads), torch.randn(hq, d, d, generator=g0),
                               torch.randn(hq, d, generator=g0), 0.95, torch.randn(hq, d, d, generator=g0),
                               torch.randn(hq, d, generator=g0), 0.9, g, torch.bfloat16, 4, 16, coded=coded)
        append_labels.append(f"append d={d} g={g} coded_bits={bits}")
        # the write split in two (WriteDefaults.beside_max_batch): the put alone, the demotion alone
        if d == 128 and bits is None:
            parts = (((new, new), dict(demote=False), "put alone"), ((None, None), {}, "demotion alone"))
            for rows, kw, label in parts:
                r_k, r_v = torch.randn(hq, d, d, generator=g0), torch.randn(hq, d, d, generator=g0)
                mu_k, mu_v = torch.randn(hq, d, generator=g0), torch.randn(hq, d, generator=g0)
                ring_write(at.append_token_triton)(*rows, win, win.clone(), hist(), hist(), torch.tensor(30),
                                                   torch.tensor([0, 1]), None, r_k, mu_k, 0.95, r_v, mu_v, 0.9, g,
                                                   torch.bfloat16, 4, 16, **kw)
                append_labels.append(f"append d={d} g={g} {label}")
    # ... with 3-bit keys (8 levels, the high bits' plane) and values at a group of their own
    from oscar_hf.quant import rows_from

    for d, g, gv, kbits in ((256, 32, 128, 3), (128, 64, 64, 3), (128, 32, 128, 2)):
        b, hk, n = 2, 4, 40
        win = torch.randn(b, hk, 4 + 17, d, generator=g0).bfloat16()
        meta = lambda gs: torch.zeros(b, hk, n, d // gs).bfloat16()  # noqa: E731
        hk_ = rows_from((torch.zeros(b, hk, n, d // 4, dtype=torch.uint8), meta(g), meta(g))
                        + ((torch.zeros(b, hk, n, d // 8, dtype=torch.uint8),) if kbits == 3 else ()))
        hv_ = QuantizedRows(torch.zeros(b, hk, n, d // 4, dtype=torch.uint8), meta(gv), meta(gv))
        new = torch.randn(b, hk, 1, d, generator=g0).bfloat16()
        ring_write(at.append_token_triton)(new, new, win, win.clone(), hk_, hv_, torch.tensor(30), torch.tensor([0, 1]),
                                           None, torch.randn(hk, d, d, generator=g0), torch.randn(hk, d, generator=g0),
                                           0.95, torch.randn(hk, d, d, generator=g0), torch.randn(hk, d, generator=g0),
                                           0.9, g, torch.bfloat16, 4, 16)
        append_labels.append(f"append d={d} g={g} gv={gv} key_bits={kbits}")
    # the serving store's decode write (its PAGED layout): a pool of 9 pages of 16 entries over 2 layers, 12 window
    # slots, 8 rows; every head INT2 at D = 128, a retrieval head at 8 bits (D = 128), 16 (D = 64), 4 (D = 96: the
    # plane-padded layout) and 8 (D = 512: 8 warps)
    from oscar_hf.kernels.kv import PagedRows
    from oscar_hf.serving.pool import HeadLayout, PagedInt2Pool

    paged_labels = []
    for d, g, heads, bits in ((128, 64, None, None), (128, 64, [1, -1, 0, 2], 8), (64, 32, [1, -1, 0, 2], 16),
                              (96, 32, [1, -1, 0, 2], 4), (512, 64, [1, -1, 0, 2], 8)):
        hk, bp = 4, 8
        hq = hk if heads is None else sum(h >= 0 for h in heads)
        pool = PagedInt2Pool(8, 2, hk, d, 16, g, layout=HeadLayout([hq] * 2, [hk - hq] * 2, bits or 8),
                             trash_page=True)
        coded = None
        if bits:
            coded_of = torch.full((hk,), -1, dtype=torch.long)
            coded_of[[i for i in range(hk) if heads[i] < 0]] = torch.arange(hk - hq)
            coded = CodedSlots(pool.coded_rows(1, "k"), pool.coded_rows(1, "v"), coded_of, bits)
        wins = torch.zeros(2, 13, 2, hk, 4 + 17, d).bfloat16()
        new = torch.randn(bp, hk, d, generator=g0).bfloat16().transpose(0, 1)  # [Hk, Q, D], the projections' layout
        rows = PagedRows(*(torch.arange(bp) for _ in range(7)))
        paged_write(at.paged_append_triton)(new, new, wins[0][:, 1], wins[1][:, 1], pool.rows(1, "k"), pool.rows(1, "v"), rows,
                               None if heads is None else torch.tensor(heads), torch.randn(hq, d, d, generator=g0),
                               torch.randn(hq, d, generator=g0), 0.95, torch.randn(hq, d, d, generator=g0),
                               torch.randn(hq, d, generator=g0), 0.9, g, torch.bfloat16, coded=coded)
        paged_labels.append(f"paged_append d={d} g={g} coded_bits={bits}")
    # what the launch sets on a GPU only (a CPU tensor's launch, recorded here, sets the interpreter's values)
    cuda_kw = {"LOWP": 1, "PRECISION": "tf32x3", "ASM": 1}
    for i, (grid, args, kw) in enumerate(split.calls):
        print(json.dumps({"kernel": "split", "case": labels[i], **compile_call(split.fn, args, kw, cuda_kw)}))
    # the window-only launch of the Gluon path (its steps software-pipelined), at the benchmark shape
    grid, args, kw = split.calls[0]
    print(json.dumps({"kernel": "split", "case": labels[0] + " window-only", **compile_call(
        split.fn, args, {**{k: v for k, v in kw.items() if k != "maxnreg"}, "WIN_STAGES": DEFAULTS.gluon_win_stages,
                         "WIN_ONLY": 1},
        cuda_kw)}))  # (no register cap on the Gluon path)
    # ... as the compiled step's layer with retrieval heads launches it: its KV heads' window and query read in place
    print(json.dumps({"kernel": "split", "case": labels[0] + " window-only, query at the window's heads", **compile_call(
        split.fn, args, {**{k: v for k, v in kw.items() if k != "maxnreg"}, "WIN_STAGES": DEFAULTS.gluon_win_stages,
                         "WIN_ONLY": 1, "WHEAD": torch.zeros(7, dtype=torch.long), "HAS_WHEAD": 1, "QW_AT_HEAD": 1},
        cuda_kw)}))
    for i in (0, 1, *range(wide, len(labels))):
        grid, args, kw = comb.calls[i]
        print(json.dumps({"kernel": "combine", "case": labels[i], **compile_call(comb.fn, args, kw, cuda_kw)}))
    # the decode op's combine as an H200 launches it with the Gluon history: few programs (B=1: 208 splits, blocks of
    # merge_block, 8 warps; merge_out_parts programs a row, of merge_warps_few warps for <= 128 splits, else 8) and many (B=8: 49 splits, B=32: 9; 4 warps),
    # R_V whole or in chunks, with the loads hoisted (the window's partials, R_V in 64-row chunks) or not, and one warp
    # per row where rows crowd the SMs (B=32, 16 splits a round, R_V in 16-row chunks); PDL as the rotating op launches it
    grid, args, kw = comb.calls[0]
    assert kw["FINAL"], kw
    for s_block, warps, c_block, hoist, parts in ((DEFAULTS.merge_block, 8, 128, 0, 1), (16, 4, 32, 0, 1),
                                                  (DEFAULTS.merge_block_few, 8, 32, 1, DEFAULTS.merge_out_parts),
                                                  (128, DEFAULTS.merge_warps_few, 32, 1, DEFAULTS.merge_out_parts),
                                                  (64, 4, 64, 1, 1), (16, 4, 64, 1, 1), (16, 1, 16, 1, 1)):
        kw2 = {**kw, "S_BLOCK": s_block, "C_BLOCK": c_block, "num_warps": warps, "HOIST": hoist,
               "SW_BLOCK": 16 if hoist else 1, "PARTS": parts, "PDL": 1}
        print(json.dumps({"kernel": "combine", "case": f"decode op s_block={s_block} warps={warps} c_block={c_block}"
                          f" hoist={hoist} parts={parts}", **compile_call(comb.fn, args, kw2, cuda_kw)}))
    # ... with a retrieval head's rows merged by the same launch (B=1/100K: 391 heads' splits + the window, 4
    # programs a row of 32 channels; B=8: 4 warps; crowded: one warp), PDL and the counters' reset as launched
    z = torch.zeros(1)
    for s_block, warps, c_block, hoist, parts, c_s in ((DEFAULTS.merge_block_few, 8, 32, 1, DEFAULTS.merge_out_parts,
                                                        392), (64, 4, 64, 1, 1, 129), (16, 1, 16, 1, 1, 40)):
        cw = 128 // parts
        kw2 = {**kw, "S_BLOCK": s_block, "C_BLOCK": c_block, "num_warps": warps, "HOIST": hoist,
               "SW_BLOCK": 16 if hoist else 1, "PARTS": parts, "PDL": 1, "CPM": z, "CPL": z, "CPACC": z,
               "CHEAD": torch.zeros(1, dtype=torch.long), "C_P": 1, "C_S_TOT": c_s, "N_INT2": 7 * 4 * parts,
               "C_M_PAD": 16, "CW": cw, "C_S_BLOCK": min(triton.next_power_of_2(c_s), s_block * 128 // cw),
               "HAS_CODED": 1, "OHEAD": torch.zeros(7, dtype=torch.long), "HK_OUT": 8, "HAS_OHEAD": 1}
        print(json.dumps({"kernel": "combine", "case": f"decode op with heads' rows s_block={s_block} warps={warps} "
                          f"parts={parts}", **compile_call(comb.fn, args, kw2, cuda_kw)}))
    # ... at head_dim 96 (few rows: 3 programs of 32 channels a row, hoisted; many: 4 warps, chunks of 32; crowded: one
    # warp, chunks of 16) and 512 (partials merged 32 at a time, 8 warps, 4 programs a row)
    grid, args, kw = comb.calls[wide]
    for s_block, warps, c_block, hoist, parts in ((DEFAULTS.merge_block_few, 8, 32, 1, 3), (64, 4, 32, 1, 1),
                                                  (16, 1, 16, 1, 1)):
        kw2 = {**kw, "S_BLOCK": s_block, "C_BLOCK": c_block, "num_warps": warps, "HOIST": hoist, "SW_BLOCK": 16,
               "PARTS": parts}
        case = f"decode op d=96 s_block={s_block} warps={warps} c_block={c_block} hoist={hoist} parts={parts}"
        print(json.dumps({"kernel": "combine", "case": case, **compile_call(comb.fn, args, kw2, cuda_kw)}))
    grid, args, kw = comb.calls[wide + 2]
    kw2 = {**kw, "S_BLOCK": DEFAULTS.merge_block_xwide, "C_BLOCK": 32, "num_warps": 8, "HOIST": 0, "PARTS": 4}
    print(json.dumps({"kernel": "combine", "case": f"decode op d=512 s_block={DEFAULTS.merge_block_xwide} warps=8 "
                      "c_block=32 hoist=0 parts=4", **compile_call(comb.fn, args, kw2, cuda_kw)}))
    for lab, (grid, args, kw) in zip(heads_labels, hsplit.calls):
        print(json.dumps({"kernel": "heads_split", "case": lab, **compile_call(hsplit.fn, args, kw, {"OP": 1})}))
    grid, args, kw = hcomb.calls[0]
    print(json.dumps({"kernel": "heads_combine", "case": heads_labels[0], **compile_call(hcomb.fn, args, kw, {})}))
    # D = 512 with a full tile of partials (the GPU's split count: merge_block of them a round)
    i = heads_labels.index("heads d=512 bits=8 hi_dev=True")
    grid, args, kw = hcomb.calls[i]
    print(json.dumps({"kernel": "heads_combine", "case": heads_labels[i] + f" s_block={HEADS_DEFAULTS.merge_block}",
                      **compile_call(hcomb.fn, args, {**kw, "S_BLOCK": HEADS_DEFAULTS.merge_block}, {})}))
    for kind, labs in (("append", append_labels), ("paged_append", paged_labels)):
        calls = [c for c in append.calls if c[2]["PAGED"] == (kind == "paged_append")]
        for lab, (grid, args, kw) in zip(labs, calls, strict=True):
            print(json.dumps({"kernel": kind, "case": lab, **compile_call(append.fn, args, kw, {})}))
    for grid, args, kw in rotq.calls:
        print(json.dumps({"kernel": "rotate_query", "case": f"d={kw['D']} m_pad={kw['M_PAD']}",
                          **compile_call(rotq.fn, args, kw, cuda_kw)}))
    for grid, args, kw in write.calls:
        case = f"write d={kw['D']} g={kw['G']} block_t={kw['BLOCK_T']}"
        print(json.dumps({"kernel": "write", "case": case, **compile_call(write.fn, args, kw, cuda_kw)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
