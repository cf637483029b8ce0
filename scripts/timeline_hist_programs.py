#!/usr/bin/env python
"""Where each program of the Gluon history kernel spends its time, inside one decode op (CUDA GPU; a diagnostic).

``profile_decode_op.py --timeline`` shows when each *kernel* of the op starts and ends; this shows the history
kernel's *programs* (and those of the launch before it, the rotation + window prologue: entry and exit; and since
session 25 those of the launch after it, the combine: entry, end of its PDL wait, exit): with
``decode_gluon.TIMES_BUF`` set, every program stamps ``%globaltimer`` at its entry, after
its PDL wait (the query rotation complete), after its reference step (the query operands built, the first step's
logits known), after its loop and at its exit, with ``%clock64``, its SM and its warp slot (scheduler) beside them
(``decode_gluon._stamp``). The op runs as the benchmark's (``bench_kernels.oscar_op``: rotation + window launch,
history, combine) in a CUDA graph with a cold L2, ``--iters`` times; each statistic is the median over the replays.

What it separates: the per-program fixed costs (the wait, the setup of the query operands, the epilogue) from the
streaming loop, and the spread of the programs' ends (the tail: SMs with more programs than others, stragglers),
which the kernel-level timeline cannot.

    python scripts/timeline_hist_programs.py --points 1x131072 --configs '{}' '{"pdl": 0}' --out timeline.json
    python scripts/timeline_hist_programs.py --plot timeline.json [more.json:ROW ...] --out timeline.png
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_kernels as bk  # noqa: E402
from oscar_hf.kernels import decode_gluon as dg  # noqa: E402
from oscar_hf.kernels import decode_triton as dt  # noqa: E402

SLOTS = ("entry", "waited", "ref_step", "loop_end", "exit")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]


def summarize(buf: torch.Tensor) -> dict:
    """Statistics of one replay's stamps ``buf [rows, TIME_SLOTS]`` (int64): the history kernel's programs in the rows
    below ``PROLOGUE_TIME_ROW``, the prologue's (rotation + window) from there on, the combine's from
    ``COMBINE_TIME_ROW`` on; times in us from the first prologue program's entry (the history's first entry where
    there is no prologue)."""
    pro = buf[dt.PROLOGUE_TIME_ROW.value:dt.COMBINE_TIME_ROW.value]
    pro = pro[pro[:, 0] != 0].double()
    comb = buf[dt.COMBINE_TIME_ROW.value:]
    comb = comb[comb[:, 0] != 0].double()
    t = buf[:dt.PROLOGUE_TIME_ROW.value]
    t = t[t[:, 0] != 0].double()
    n = t.shape[0]
    t0 = min(t[:, 0].min(), pro[:, 0].min()) if pro.shape[0] else t[:, 0].min()
    out = {}
    for kind, name in ((0, "rotation"), (1, "window")):
        r = pro[pro[:, 3] == kind]
        if r.shape[0]:
            ent, ext = ((r[:, 0] - t0) / 1e3).tolist(), ((r[:, 4] - t0) / 1e3).tolist()
            out[f"prologue_{name}"] = {"programs": r.shape[0], "entry_max": max(ent), "exit_p50": _pct(ext, 0.5),
                                       "exit_max": max(ext)}
            if kind == 0 and (r[:, [1, 2, 5]] != 0).all():  # the rotation programs building the int8 operands
                # (gluon_qpre, query_triton._rotate_plane_q8) stamp
                # after their product, after sigma_g and after their sums
                for slot, mark in ((1, "product"), (2, "sigma"), (5, "sums")):
                    col = ((r[:, slot] - t0) / 1e3).tolist()
                    out[f"prologue_{name}"][f"{mark}_p50"] = _pct(col, 0.5)
                    out[f"prologue_{name}"][f"{mark}_max"] = max(col)
    if comb.shape[0]:  # the combine's programs (the decode op's hoisted combine): entry, end of its wait, exit
        out["combine"] = {"programs": comb.shape[0]}
        for slot, name in ((0, "entry"), (1, "waited"), (4, "exit")):
            col = ((comb[:, slot] - t0) / 1e3).tolist()
            out["combine"].update({f"{name}_p10": _pct(col, 0.1), f"{name}_p50": _pct(col, 0.5),
                                   f"{name}_max": max(col)})
    rel = (t[:, :5] - t0) / 1e3  # us from the first program's entry
    dur = {f"{SLOTS[i]}->{SLOTS[i + 1]}": (t[:, i + 1] - t[:, i]) / 1e3 for i in range(4)}
    out["programs"] = n
    for i, name in enumerate(SLOTS):
        col = rel[:, i].tolist()
        out[f"{name}_us"] = {"min": min(col), "p10": _pct(col, 0.1), "p50": _pct(col, 0.5), "p90": _pct(col, 0.9),
                             "max": max(col)}
    for name, d in dur.items():
        col = d.tolist()
        out[f"{name}_us"] = {"p10": _pct(col, 0.1), "p50": _pct(col, 0.5), "p90": _pct(col, 0.9), "max": max(col)}
    ns = (t[:, 4] - t[:, 0]).clamp(min=1)
    out["sm_clock_ghz_p50"] = float(((t[:, 6] - t[:, 5]) / ns).median())
    sm = (t[:, 7].long() & 0xFFFF).tolist()
    # the warp's scheduler (warp slot % 4): how unevenly an SM's one-warp programs share its four schedulers, and
    # whether a program's end follows how many programs its scheduler held
    sched = [(s, (int(v) >> 16) % 4) for s, v in zip(sm, t[:, 7].long().tolist())]
    per_sched = collections.Counter(sched)
    by_load = collections.defaultdict(list)
    for key, e in zip(sched, rel[:, 4].tolist()):
        by_load[per_sched[key]].append(e)
    out["exit_us_by_programs_on_scheduler"] = {str(k): {"n": len(v), "p50": _pct(v, 0.5), "max": max(v)}
                                               for k, v in sorted(by_load.items())}
    per_sm = collections.Counter(sm)
    out["sms_used"] = len(per_sm)
    out["programs_per_sm"] = dict(sorted(collections.Counter(per_sm.values()).items()))
    # the SMs' last exits: how far apart they end, by how many programs they held
    last = collections.defaultdict(float)
    for s, e in zip(sm, rel[:, 4].tolist()):
        last[s] = max(last[s], e)
    by_count = collections.defaultdict(list)
    for s, e in last.items():
        by_count[per_sm[s]].append(e)
    out["sm_last_exit_us_by_programs"] = {str(k): {"n": len(v), "p50": _pct(v, 0.5), "max": max(v)}
                                          for k, v in sorted(by_count.items())}
    # the history programs on SMs that also ran a prologue program (whose registers hold back some of the SM's
    # history programs until it exits) against the rest: entry and exit
    if pro.shape[0]:
        psm = set((pro[:, 7].long() & 0xFFFF).tolist())
        for tag, want in (("prologue_sms", True), ("other_sms", False)):
            sel = [i for i, s in enumerate(sm) if (s in psm) == want]
            if sel:
                for slot, name in ((0, "entry"), (4, "exit")):
                    col = rel[sel, slot].tolist()
                    out[f"{name}_us_{tag}"] = {"n": len(col), "sms": len({sm[i] for i in sel}), "p50": _pct(col, 0.5),
                                               "p90": _pct(col, 0.9), "max": max(col)}
    return out


def median_dict(ds):
    """Elementwise median of a list of equally shaped nested dicts of numbers."""
    first = ds[0]
    if isinstance(first, dict):
        return {k: median_dict([d[k] for d in ds if k in d]) for k in first}
    return statistics.median(ds)


def run_point(b, t, cfg, iters, gen):
    st = bk.make_decode(b, t, gen)
    op = bk.oscar_op(st)
    base = dict(dt.CONFIG)
    dt.CONFIG.update(cfg)
    try:
        untimed_ms = bk.timed(op, graph=True)
        buf = torch.zeros(1 << 16, dg.TIME_SLOTS, dtype=torch.int64, device="cuda")
        dg.TIMES_BUF = buf
        try:
            stamped_ms = bk.timed(op, graph=True)
            g = bk.capture_graph(op)
            sums = []
            for _ in range(iters):
                buf.zero_()
                bk.flush_l2()
                g.replay()
                torch.cuda.synchronize()
                sums.append(summarize(buf.cpu()))
        finally:
            dg.TIMES_BUF = None
    finally:
        dt.CONFIG.clear()
        dt.CONFIG.update(base)
    return {"B": b, "T": t, "config": cfg, "graph_us": untimed_ms * 1e3, "graph_us_stamped": stamped_ms * 1e3,
            "programs": median_dict(sums)}


def show(row):
    p = row["programs"]
    print(f"B={row['B']} T={row['T']} {json.dumps(row['config'])}: graph {row['graph_us']:.1f} us "
          f"(stamped {row['graph_us_stamped']:.1f}), {p['programs']:.0f} programs on {p['sms_used']:.0f} SMs "
          f"{p['programs_per_sm']}, SM clock {p['sm_clock_ghz_p50']:.2f} GHz")
    for name in ("rotation", "window"):
        if f"prologue_{name}" in p:
            s = p[f"prologue_{name}"]
            print(f"   prologue's {s['programs']:.0f} {name} programs: last entry {s['entry_max']:.1f}, exit p50 "
                  f"{s['exit_p50']:.1f} max {s['exit_max']:.1f} us")
            if "product_p50" in s:
                print("      " + ", ".join(f"{mark} p50 {s[mark + '_p50']:.1f} max {s[mark + '_max']:.1f}"
                                           for mark in ("product", "sigma", "sums")) + " us")
    if "combine" in p:
        c = p["combine"]
        print(f"   combine's {c['programs']:.0f} programs: " + ", ".join(
            f"{name} p10 {c[name + '_p10']:.1f} p50 {c[name + '_p50']:.1f} max {c[name + '_max']:.1f}"
            for name in ("entry", "waited", "exit")) + " us")
    for name in SLOTS:
        s = p[f"{name}_us"]
        print(f"   {name:>9} at  min {s['min']:6.1f}  p10 {s['p10']:6.1f}  p50 {s['p50']:6.1f}  p90 {s['p90']:6.1f}"
              f"  max {s['max']:6.1f} us")
    for i in range(4):
        k = f"{SLOTS[i]}->{SLOTS[i + 1]}"
        s = p[f"{k}_us"]
        print(f"   {k:>20}  p10 {s['p10']:6.2f}  p50 {s['p50']:6.2f}  p90 {s['p90']:6.2f}  max {s['max']:6.2f} us")
    print("   exits by programs on the program's scheduler: " + ", ".join(
        f"{k}: n={v['n']:.0f} p50 {v['p50']:.1f} max {v['max']:.1f}"
        for k, v in p.get("exit_us_by_programs_on_scheduler", {}).items()))
    print("   SMs' last exit by programs held: " + ", ".join(
        f"{k}: n={v['n']:.0f} p50 {v['p50']:.1f} max {v['max']:.1f}" for k, v in p["sm_last_exit_us_by_programs"].items()))
    for tag, what in (("prologue_sms", "on SMs that ran a prologue program"), ("other_sms", "on the other SMs")):
        if f"entry_us_{tag}" in p:
            e, x = p[f"entry_us_{tag}"], p[f"exit_us_{tag}"]
            print(f"   {e['n']:.0f} programs {what} ({e['sms']:.0f}): entry p50 {e['p50']:.1f} p90 {e['p90']:.1f} max "
                  f"{e['max']:.1f}, exit p50 {x['p50']:.1f} p90 {x['p90']:.1f} max {x['max']:.1f} us")


def _plot_source(spec: str):
    """``PATH`` or ``PATH:ROW`` -> (path, the result, its row ROW among those with per-program stamps: 0 by default;
    an IndexError naming the path where it has no such row)."""
    path, _, idx = spec.rpartition(":") if re.fullmatch(r".*:\d+", spec) else (spec, "", "0")
    res = json.loads(Path(path).read_text())
    rows = [r for r in res["rows"] if "programs" in r]
    if int(idx) >= len(rows):
        raise IndexError(f"{path}: row {idx} asked for, {len(rows)} rows with per-program stamps")
    return path, res, rows[int(idx)]


def plot(paths, out):
    """One PNG of one row of each result JSON (``PATH``: its first, ``PATH:ROW``: that one): per stamp, the programs'
    p10-p90 range (bar) with min / p50 / max marks, and the prologue's rotation / window programs' last exits -- where
    the history's programs wait, set up, stream and end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(paths), 1, figsize=(9, 2.8 * len(paths)), squeeze=False, sharex=True)
    for ax, spec in zip(axes[:, 0], paths):
        path, res, row = _plot_source(spec)
        p = row["programs"]
        for y, name in enumerate(SLOTS):
            s = p[f"{name}_us"]
            ax.barh(y, s["p90"] - s["p10"], left=s["p10"], color="C0", alpha=0.5)
            ax.plot([s["min"], s["p50"], s["max"]], [y] * 3, "k|", markersize=12)
        for name, col in (("rotation", "C1"), ("window", "C2")):
            if f"prologue_{name}" in p:
                ax.axvline(p[f"prologue_{name}"]["exit_max"], color=col, ls="--", label=f"last {name} program's exit")
        ax.set_yticks(range(len(SLOTS)), list(SLOTS))
        ax.invert_yaxis()
        ax.set_xlabel("us from the prologue's start")
        ax.set_xlim(left=0)
        cfg = json.dumps(row.get("config") or {})
        ax.set_title(f"{Path(path).stem} {cfg}\n{res['device']}: B={row['B']} T={row['T']}, {p['programs']:.0f} "
                     f"history programs (graph {row['graph_us']:.1f} us)", fontsize=8)
        ax.legend(fontsize=7, loc="center")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plot", nargs="+", help="only make a PNG (--out) from existing result JSONs (first row each)")
    ap.add_argument("--points", default="1x131072")
    ap.add_argument("--configs", nargs="*", default=["{}"])
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", required=True)
    bk.add_flush_arg(ap)
    args = ap.parse_args()
    if args.plot:
        return plot(args.plot, args.out)
    bk.FLUSH = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    bk.FLUSH_MODE = args.flush
    gen = torch.Generator().manual_seed(0)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "command": " ".join(sys.argv),
           "flush": args.flush, "rows": []}
    for pt in args.points.split(","):
        b, t = (int(x) for x in pt.split("x"))
        for cj in args.configs:
            try:
                row = run_point(b, t, json.loads(cj), args.iters, gen)
            except Exception as e:  # a config that does not run the Gluon kernel or does not compile: record it
                res["rows"].append({"B": b, "T": t, "config": json.loads(cj), "error": repr(e)[:300]})
                print(f"B={b} T={t} {cj}: failed {repr(e)[:300]}")
                continue
            res["rows"].append(row)
            show(row)
            Path(args.out).write_text(json.dumps(res, indent=1))
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
