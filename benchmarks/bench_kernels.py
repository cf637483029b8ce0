#!/usr/bin/env python
"""Benchmark the OSCAR Triton kernels against BF16 SDPA on one CUDA GPU; writes one JSON file.

Decode (one new token, Hq=32, Hk=8, D=128 by default -- ``--q-heads`` / ``--kv-heads`` / ``--head-dim`` for other
attention shapes, e.g. gpt-oss 64 / 8 / 64, Gemma 3 12B 16 / 8 / 256, Qwen3-Next 16 / 2 / 256 --, G=64 bf16
metadata -- ``--group-size`` / ``--meta-dtype`` for others, e.g. the authors' preset: 128 / float32 --, sink 64 +
recent 256 = 320 BF16 window tokens, the rest INT2 history; total length T):
* ``oscar``: the whole decode attention op (with the kernel defaults, ``oscar_hf.kernels.plan.DEFAULTS``, or
  ``--config`` overrides of them): :func:`decode_attention_triton` from the unrotated query, as in the model's
  attention -- query rotation ``q R_K`` and centering offset ``q · mu_K``, split-K over history and window, then
  merge + ``R_Vᵀ`` + ``mu_V`` + normalize; 3 launches (on the Gluon path the rotation shares its launch with the window programs);
* ``sdpa``: ``F.scaled_dot_product_attention(q, K, V, enable_gqa=True)`` on BF16 K/V of length T,
  each available backend forced in turn; the fastest is the baseline.
Every timing is the median over calls with a cold L2 (a 256 MB buffer is zeroed and read back before each
call, outside the timed region: ``flush_l2``), measured with CUDA events around each call, eagerly and as a replayed
CUDA graph (four calls back to back in one graph, as a captured decode step runs its layers: ``bench_kernels.py`` at
d1f081d). Bandwidth: bytes the op must
read (INT2 codes + scale/zero of K and V, BF16 window) over its time, against a measured device-to-device copy
(bytes read + written).

Write path: ``rotate_quantize_triton`` on [1, Hk, 32768, D] BF16 rows (rows/s, GB/s) and its time
(K and V) relative to BF16 causal prefill attention (SDPA, B=1, Hq query heads, T=32K). The tile sweeps that chose
the defaults (``--sweep``) are ``bench_kernels.py`` at 78f7d51.

Usage: python benchmarks/bench_kernels.py --batches 1,8,32 --lengths 8192,32768,131072 \
           --out benchmarks/results/kernels_h100.json [--config '{"gluon_min_work": 0}']
       python benchmarks/bench_kernels.py --group-size 128 --meta-dtype float32 --batches 1,8 --lengths 32768,131072 \
           --out benchmarks/results/kernels_preset_h100.json      (the authors' preset: OscarConfig.reference())
       python benchmarks/bench_kernels.py --head-dim 64 --q-heads 64 --kv-heads 8 --batches 1,8 --lengths 32768,131072 \
           --no-write --out benchmarks/results/kernels_h100_d64.json      (gpt-oss's attention shape)
       python benchmarks/bench_kernels.py --plot benchmarks/results/kernels_h100.json   (CPU: the PNG beside it)
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import platform
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from oscar_hf.kernels import decode_triton as dt
from oscar_hf.kernels.int2_attention import decode_attention_reference
from oscar_hf.kernels.kv import History, KVParams, Window
from oscar_hf.kernels.plan import DEFAULTS, group_fits
from oscar_hf.kernels.write_path import rotate_quantize_reference
from oscar_hf.kernels.write_triton import rotate_quantize_triton
from oscar_hf.quant import QuantizedRows, rows_from

HQ, HK, D, GS = 32, 8, 128, 64  # --q-heads, --kv-heads, --head-dim, --group-size (set_shape sets them and what follows)
META = torch.bfloat16  # scale / zero dtype of the INT2 history: --meta-dtype
KBITS, GV = 2, GS  # the keys' code bits (--key-bits) and the values' group (--value-group-size; default: the keys')
META_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
GQ = HQ // HK
SINK, RECENT = 64, 256
W = SINK + RECENT
NG = D // GS
SCALING = D**-0.5
FLUSH = None
KERNEL_DEFAULTS = DEFAULTS  # the decode kernels' defaults of this run (--config: dataclasses.replace of DEFAULTS)


def log(*a):
    print(*a, flush=True)


# ------------------------------------------------------------------------------------------- timing


def capture_graph(fn) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of one call of ``fn`` (two warm-up calls on a side stream first: compilation, allocator)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def timed(fn, *, graph=False, iters=30, warmup=3):
    """Median ms of ``fn`` with a cold L2 (flush before each call, not timed)."""
    call = capture_graph(fn).replay if graph else fn
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for a, b in ev:
        flush_l2()
        a.record()
        call()
        b.record()
    torch.cuda.synchronize()
    ts = sorted(a.elapsed_time(b) for a, b in ev)
    return ts[len(ts) // 2]


def flush_l2():
    """Make the L2 cold before a timed call (untimed): zero the 256 MB ``FLUSH`` buffer, then read it back, so that
    the write-back of its dirty lines happens here and the timed call finds clean lines of an unrelated buffer, as in
    a model's decode step (zeroing alone charged each call up to one L2 of write-back: docs/kernels.md, ab1cc7e)."""
    FLUSH.zero_()
    FLUSH.view(torch.int32).sum(dtype=torch.int32)  # (the name of its kernel: "reduce_kernel")


def copy_bandwidth_gbps():
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), iters=20)
    return 2 * x.numel() / ms / 1e6  # read + write, GB/s


# --------------------------------------------------------------------------------------------- data


def orthogonal(n, d, gen):
    a = torch.randn(n, d, d, generator=gen, dtype=torch.float64)
    return torch.linalg.qr(a)[0].float().contiguous()  # as the cache holds them (LayerRotation.to)


def make_decode(b, t, gen):
    """Random but valid decode state: INT2 history of T - W tokens, BF16 window of W, BF16 K/V of T."""
    n = t - W
    dev = "cuda"

    def qrows(ng, hi=False):  # (hi: 3-bit keys' high bits [B, Hk, N, D/8])
        return rows_from((
            torch.randint(0, 256, (b, HK, n, D // 4), dtype=torch.uint8, device=dev),
            (torch.rand(b, HK, n, ng, device=dev) * 0.1 + 0.02).to(META),
            (torch.randn(b, HK, n, ng, device=dev) * 0.5 - 0.15).to(META),
        ) + ((torch.randint(0, 256, (b, HK, n, D // 8), dtype=torch.uint8, device=dev),) if hi else ()))

    st = dict(
        n=n, k=qrows(NG, KBITS == 3), v=qrows(D // GV),
        k_win=torch.randn(b, HK, W, D, device=dev, dtype=torch.bfloat16),
        v_win=torch.randn(b, HK, W, D, device=dev, dtype=torch.bfloat16),
        q=torch.randn(b, HQ, 1, D, device=dev, dtype=torch.bfloat16),
        r_k=orthogonal(HK, D, gen).cuda(), r_v=orthogonal(HK, D, gen).cuda(),
        mu_k=(torch.randn(HK, D, generator=gen) * 0.3).cuda(), mu_v=(torch.randn(HK, D, generator=gen) * 0.3).cuda(),
        start=torch.zeros(b, dtype=torch.long, device=dev),
    )
    st["mu_rot_k"] = torch.matmul(st["mu_k"].unsqueeze(1), st["r_k"]).squeeze(1)  # mu_K R_K, offline
    return st


def oscar_op(st):
    b = st["q"].shape[0]
    qg = st["q"].view(b, HK, GQ, D)  # query heads of one KV head are consecutive (repeat_kv order)

    def run():  # the query rotated inside the op, as in the model's attention (rotation + window: one launch)
        out = dt.decode_attention_triton(
            KVParams(st["r_k"], st["mu_k"], st["r_v"], st["mu_v"], GS), qg, Window(st["k_win"], st["v_win"]),
            History(st["k"], st["v"], st["start"]), SCALING, torch.bfloat16, defaults=KERNEL_DEFAULTS,
        )
        return out.view(b, HQ, 1, D)

    return run


SDPA_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
                 "efficient": SDPBackend.EFFICIENT_ATTENTION}


def sdpa_op(q, k, v, backend=None, causal=False):
    def run():
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        with ctx:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    return run


# ------------------------------------------------------------------------------------------ benches


def bench_decode(gen, batches, lengths, copy_bw, rows=None, save=lambda: None):
    rows = [] if rows is None else rows
    for b, t in itertools.product(batches, lengths):
        kv_bytes = 2 * b * HK * t * D * 2
        free = torch.cuda.mem_get_info()[0]
        if kv_bytes * 1.4 > free:
            log(f"skip B={b} T={t}: BF16 K/V need {kv_bytes / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
            continue
        st = make_decode(b, t, gen)
        row = {"B": b, "T": t, "history": st["n"], "window": W}
        sk = torch.randn(b, HK, t, D, device="cuda", dtype=torch.bfloat16)
        sv = torch.randn(b, HK, t, D, device="cuda", dtype=torch.bfloat16)
        sdpa = {}
        for name, be in SDPA_BACKENDS.items():
            try:
                fn = sdpa_op(st["q"], sk, sv, be)
                fn()
                torch.cuda.synchronize()
                sdpa[name] = timed(fn)
            except Exception as e:
                sdpa[name] = None
                row.setdefault("sdpa_errors", {})[name] = repr(e)[:160]
        sdpa["default"] = timed(sdpa_op(st["q"], sk, sv))
        row["sdpa_ms"] = sdpa
        best_name = min((k for k, v in sdpa.items() if v is not None), key=lambda k: sdpa[k])
        row["sdpa_best"] = best_name
        row["sdpa_best_ms"] = sdpa[best_name]
        try:
            row["sdpa_best_graph_ms"] = timed(sdpa_op(st["q"], sk, sv, SDPA_BACKENDS.get(best_name)), graph=True)
        except Exception as e:
            row["sdpa_best_graph_ms"] = None
            row["sdpa_graph_error"] = repr(e)[:160]
        del sk, sv
        op = oscar_op(st)
        row["oscar_ms"] = timed(op)
        row["oscar_graph_ms"] = timed(op, graph=True)
        # K and V: the history's codes (3-bit keys: their high bits too) + scale + zero, and the BF16 window
        row["oscar_bytes"] = b * HK * (st["n"] * (2 * (D // 4) + (D // 8) * (KBITS == 3)
                                                  + 2 * (NG + D // GV) * META.itemsize) + 2 * W * D * 2)
        row["oscar_GBps"] = row["oscar_bytes"] / row["oscar_ms"] / 1e6
        row["oscar_pct_copy_bw"] = 100 * row["oscar_GBps"] / copy_bw
        row["oscar_graph_pct_copy_bw"] = graph_pct_copy_bw(row, copy_bw)
        row["sdpa_GBps"] = kv_bytes / row["sdpa_best_ms"] / 1e6
        row["speedup"] = row["sdpa_best_ms"] / row["oscar_ms"]
        if row["sdpa_best_graph_ms"]:
            row["speedup_graph"] = row["sdpa_best_graph_ms"] / row["oscar_graph_ms"]
        if b == 1 and t == 32768:  # spot-check the fused op against the torch reference here
            out = op()
            q_rot = torch.matmul(st["q"].view(b, HK, GQ, D).float(), st["r_k"])
            ref = decode_attention_reference(
                KVParams(st["r_k"], st["mu_k"], st["r_v"], st["mu_v"], GS), st["q"].view(b, HK, GQ, D),
                Window(st["k_win"], st["v_win"]), History(st["k"], st["v"], st["start"]), SCALING, torch.float32,
                rotated=(q_rot, torch.matmul(q_rot, st["mu_rot_k"].unsqueeze(-1)).squeeze(-1)),
            ).view(b, HQ, 1, D)
            row["rel_err_vs_reference"] = ((out.float() - ref).norm() / ref.norm()).item()
        log(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items() if k != "sdpa_errors"}))
        rows.append(row)
        save()
        del st, op
        torch.cuda.empty_cache()
    return rows


def bench_write(gen, copy_bw, t=32768):
    from oscar_hf.kernels import write_triton as wt
    from oscar_hf.quant import unpack_int2

    x = torch.randn(1, HK, t, D, device="cuda", dtype=torch.bfloat16)
    r = orthogonal(HK, D, gen).cuda()
    mu = torch.randn(HK, D, device="cuda") * 0.3
    store = QuantizedRows(
        torch.empty(1, HK, t, D // 4, dtype=torch.uint8, device="cuda"),
        torch.empty(1, HK, t, NG, dtype=META, device="cuda"),
        torch.empty(1, HK, t, NG, dtype=META, device="cuda"),
    )
    res = {"T": t, "rows": HK * t}
    block_t = wt.BLOCK_T
    res["config"] = {"block_t": block_t, "num_warps": wt.NUM_WARPS}
    res["triton_ms"] = timed(lambda: rotate_quantize_triton(x, r, mu, 0.96, GS, META, out=store,
                                                            block_t=block_t))
    res["reference_ms"] = timed(lambda: rotate_quantize_reference(x, r, mu, 0.96, GS, META, out=store), iters=10)
    nbytes = x.numel() * 2 + store.codes.numel() + 2 * store.scale.numel() * META.itemsize
    res["rows_per_s"] = HK * t / (res["triton_ms"] / 1e3)
    res["GBps"] = nbytes / res["triton_ms"] / 1e6
    res["pct_copy_bw"] = 100 * res["GBps"] / copy_bw
    # decode-time demotion: one row per sequence, B = 8
    x1 = torch.randn(8, HK, 1, D, device="cuda", dtype=torch.bfloat16)
    st1 = QuantizedRows(*(torch.empty(8, HK, 4, s.shape[-1], dtype=s.dtype, device="cuda") for s in store))
    res["demote_one_row_B8_us"] = 1e3 * timed(lambda: rotate_quantize_triton(x1, r, mu, 0.96, GS, META, out=st1, out_offset=2))
    # share of a BF16 prefill at the same length: causal SDPA, B = 1, HQ query heads
    q = torch.randn(1, HQ, t, D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, HK, t, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    prefill = {}
    for name, be in list(SDPA_BACKENDS.items()) + [("default", None)]:
        try:
            prefill[name] = timed(sdpa_op(q, k, v, be, causal=True), iters=10)
        except Exception as e:
            prefill[name] = None
            res.setdefault("prefill_errors", {})[name] = repr(e)[:160]
    best = min((k_ for k_, v_ in prefill.items() if v_ is not None), key=lambda k_: prefill[k_])
    res["prefill_sdpa_ms"] = prefill
    res["prefill_best"] = best
    res["write_share_of_prefill_attention_pct"] = 100 * 2 * res["triton_ms"] / prefill[best]  # K and V
    # sanity: the kernel agrees with the reference at this size
    a = rotate_quantize_triton(x, r, mu, 0.96, GS, META)
    ref = rotate_quantize_reference(x, r, mu, 0.96, GS, META)
    res["codes_mismatch_frac"] = (unpack_int2(a.codes) != unpack_int2(ref.codes)).float().mean().item()
    res["scale_max_abs_diff"] = (a.scale.float() - ref.scale.float()).abs().max().item()
    log(json.dumps(res))
    return res


def graph_pct_copy_bw(row, copy_bw):
    """% of the copy bandwidth the op's bytes (INT2 history + BF16 window) reach in its CUDA-graph time (the eager
    time of a small call is mostly the host's)."""
    return 100 * row["oscar_bytes"] / row["oscar_graph_ms"] / 1e6 / copy_bw


def plot(path):
    """Speedup over the best BF16 SDPA vs T, one line per batch size (eager and CUDA graph), and the
    achieved share of copy bandwidth; written next to the JSON as ``<name>_speedup.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        res = json.load(f)
    rows = res["decode"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for b in sorted({r["B"] for r in rows}):
        rs = sorted((r for r in rows if r["B"] == b), key=lambda r: r["T"])
        t = [r["T"] // 1024 for r in rs]
        (line,) = axes[0].plot(t, [r["speedup"] for r in rs], "o-", label=f"B={b} eager")
        axes[0].plot(t, [r.get("speedup_graph", float("nan")) for r in rs], "s--", color=line.get_color(), label=f"B={b} CUDA graph")
        if any("speedup_graph_seq" in r for r in rs):  # results of d1f081d and before: 4 calls in one graph
            axes[0].plot(t, [r.get("speedup_graph_seq", float("nan")) for r in rs], "^:", color=line.get_color(),
                         label=f"B={b} graph of 4 calls")
        axes[1].plot(t, [r["oscar_pct_copy_bw"] for r in rs], "o-", color=line.get_color(), label=f"B={b} eager")
        axes[1].plot(t, [graph_pct_copy_bw(r, res["copy_GBps"]) for r in rs], "s--", color=line.get_color(),
                     label=f"B={b} CUDA graph")
    axes[0].axhline(1.0, color="gray", lw=0.8)
    sh = res.get("shape", {})
    target = 4.5 if sh.get("D", 128) == 128 else 3.0  # issue 50's target for head_dim 64 / 256: 3x at B=8/128K
    axes[0].axhline(target, color="red", lw=0.8, ls=":", label=f"target {target}x")
    dims = f"\nHq {sh['Hq']}, Hk {sh['Hk']}, D {sh['D']}" if (sh.get("D", 128), sh.get("Hq", 32)) != (128, 32) else ""
    axes[0].set(xscale="log", xlabel="context T (K tokens)", ylabel="speedup vs BF16 SDPA",
                title=f"OSCAR INT2 decode attention, {res['device']}{dims}")
    axes[1].axhline(70, color="red", lw=0.8, ls=":", label="target 70%")
    axes[1].set(xscale="log", xlabel="context T (K tokens)", ylabel="% of D2D copy bandwidth",
                title=f"INT2 bytes / time (copy {res['copy_GBps']:.0f} GB/s)")
    for ax in axes:
        ax.set_xticks(sorted({r["T"] // 1024 for r in rows}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    out = path.rsplit(".json", 1)[0] + "_speedup.png"
    fig.savefig(out, dpi=120)
    print("wrote", out)


def set_shape(group_size: int, meta_dtype: str, head_dim: int = 128, q_heads: int = 32, kv_heads: int = 8,
              key_bits: int = 2, value_group_size: int | None = None) -> None:
    """The attention shape (``--head-dim``, ``--q-heads``, ``--kv-heads``) and the history's quantization shape
    (``--group-size``, ``--meta-dtype``) of this run: module globals that every bench reads. Refuses a shape the decode
    kernels do not serve (``decode_triton.kernel_supported``: the op would take the torch reference, not what is
    meant to be timed)."""
    global HQ, HK, D, GQ, NG, SCALING, GS, META, KBITS, GV
    if kv_heads < 1 or q_heads % kv_heads:
        raise SystemExit(f"--q-heads must be a multiple of --kv-heads, got {q_heads} / {kv_heads}")
    if not group_fits(head_dim, group_size):
        raise SystemExit(f"--group-size must divide --head-dim={head_dim} as a power of two or a whole number of "
                         f"head_dim/4-channel planes (kernels.plan.group_fits), got {group_size}")
    HQ, HK, D, GQ = q_heads, kv_heads, head_dim, q_heads // kv_heads
    GS, NG, META = group_size, D // group_size, META_DTYPES[meta_dtype]
    KBITS, GV = key_bits, value_group_size or group_size
    SCALING = D**-0.5
    meta = torch.empty(1, HK, 1, NG, dtype=META)
    probe = rows_from((torch.empty(1, HK, 1, D // 4, dtype=torch.uint8), meta, meta)
                      + ((torch.empty(1, HK, 1, D // 8, dtype=torch.uint8),) if KBITS == 3 else ()))
    if not dt.kernel_supported(torch.empty(1, HK, GQ, D), probe, GS, None, value_group=GV):
        raise SystemExit(f"the decode kernels do not serve Hq={HQ}, Hk={HK}, D={D}, G={GS} (kernel_supported)")


def main(argv=None):
    global FLUSH, KERNEL_DEFAULTS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--plot", help="only make the PNG from an existing result JSON")
    ap.add_argument("--no-write", action="store_true", help="skip the write-path benchmark")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--lengths", default="8192,32768,131072")
    ap.add_argument("--config", default="{}", help="overrides of the decode kernels' defaults (JSON of "
                    "oscar_hf.kernels.plan.DecodeDefaults fields, e.g. '{\"gluon_min_work\": 0}')")
    ap.add_argument("--group-size", type=int, default=GS, help=f"channels per scale/zero group of the INT2 history "
                    f"(default {GS}; = --head-dim: one group per head, the authors' preset)")
    ap.add_argument("--head-dim", type=int, default=D, help=f"head_dim of the attention layer (default {D}; 64: "
                    "gpt-oss, Llama 3.2 1B; 256: Gemma 3, Qwen3-Next / Qwen3.5)")
    ap.add_argument("--q-heads", type=int, default=HQ, help=f"query heads (default {HQ})")
    ap.add_argument("--kv-heads", type=int, default=HK, help=f"KV heads (default {HK})")
    ap.add_argument("--meta-dtype", choices=sorted(META_DTYPES), default="bfloat16",
                    help="dtype of the history's scale/zero (default bfloat16; the authors' preset: float32)")
    ap.add_argument("--key-bits", type=int, choices=(2, 3), default=2, help="the keys' code bits (3: OscarConfig "
                    "key_bits=3, the split kernel's dequant loop)")
    ap.add_argument("--value-group-size", type=int, default=None, help="the values' group (default: --group-size; "
                    "another: OscarConfig value_group_size)")
    args = ap.parse_args(argv)
    set_shape(args.group_size, args.meta_dtype, args.head_dim, args.q_heads, args.kv_heads, args.key_bits,
              args.value_group_size)
    if args.plot:
        return plot(args.plot)
    assert args.out and torch.cuda.is_available(), "--out and a CUDA device are needed to benchmark"
    torch.backends.cuda.matmul.allow_tf32 = False
    FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    gen = torch.Generator().manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    result = {
        "device": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "shape": {"Hq": HQ, "Hk": HK, "D": D, "group_size": GS, "meta": args.meta_dtype, "sink": SINK, "recent": RECENT,
                  "key_bits": KBITS, "value_group_size": GV},
        "command": " ".join(sys.argv), "flush": "clean",
    }

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    result["copy_GBps"] = copy_bandwidth_gbps()
    log("copy bandwidth GB/s (read+write):", round(result["copy_GBps"], 1))
    KERNEL_DEFAULTS = dataclasses.replace(DEFAULTS, **json.loads(args.config))
    result["config"] = dataclasses.asdict(KERNEL_DEFAULTS)
    log("config", result["config"])
    batches = [int(x) for x in args.batches.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    save()
    if not args.no_write:  # first: short, and its numbers survive a decode run cut off by a time limit
        result["write"] = bench_write(gen, result["copy_GBps"])
        save()
    result["decode"] = []
    bench_decode(gen, batches, lengths, result["copy_GBps"], result["decode"], save)
    log("\n B      T   sdpa(ms)  oscar(ms)  speedup  graph-speedup  oscar GB/s  %copy")
    for r in result["decode"]:
        log(f"{r['B']:>2} {r['T']:>6}  {r['sdpa_best_ms']:8.4f}  {r['oscar_ms']:9.4f}  {r['speedup']:7.2f}  "
            f"{r.get('speedup_graph', float('nan')):13.2f}  "
            f"{r['oscar_GBps']:10.0f}  {r['oscar_pct_copy_bw']:5.1f}")
    w = result.get("write")
    if w:
        log(f"write: {w['rows_per_s'] / 1e6:.1f} M rows/s, {w['GBps']:.0f} GB/s, share of 32K prefill attention "
            f"{w['write_share_of_prefill_attention_pct']:.2f}%")


if __name__ == "__main__":
    main()
