"""How much the Gluon history kernel's query precision costs (GPU): the kernel's error against the reference (float32
logits from the same INT2 codes) for each key path -- fp16 operands (``gluon_k8`` 0), int8 ``(hi, lo)`` pairs
(``gluon_k8`` 2) -- beside the error the INT2 cache itself makes (the reference on the quantized keys / values against
exact attention on the float ones), on queries with and without outlier channels and with planes of unequal size.

    python scripts/gluon_q8_precision.py --out q8_precision.json

Prints one line a case; ``--out`` writes them as JSON. Errors are relative (Frobenius) over the normalised history
outputs ``acc / l`` of all rows, and the largest log-sum-exp difference (natural log units)."""
from __future__ import annotations

import argparse
import json

import torch

from oscar_hf.kernels import decode_triton as dt
from oscar_hf.kernels.int2_attention import history_partial_reference
from oscar_hf.quant import QuantizedRows, quantize_rows

# (session 19 measured a third path here, one int8 query operand a plane -- gluon_k8_lo 0, since removed: its rows in
# benchmarks/results/q8_precision_h200_session19a.json ran at commit f4ddcb2)
PATHS = {"fp16": {"gluon_k8": 0}, "int8_hilo": {"gluon_k8": 2}}


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def queries(kind, b, hk, m, d, gen):
    """Query rows of one kind: gaussian, with 2 outlier channels a row (x20), or with one plane of each group 8x the
    other (the odd planes, or the even)."""
    q = torch.randn(b, hk, m, d, generator=gen)
    if kind == "outliers":
        idx = torch.randint(0, d, (b, hk, m, 2), generator=gen)
        q.scatter_(-1, idx, q.gather(-1, idx) * 20)
    elif kind in ("odd_planes_large", "even_planes_large"):
        big = (1, 3) if kind == "odd_planes_large" else (0, 2)
        for p in big:
            q[..., 32 * p:32 * p + 32] *= 8
    return q


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32768, help="history tokens")
    ap.add_argument("--logit-scale", type=float, nargs="+", default=[1.0, 3.0],
                    help="key magnitudes (sharper attention at larger values)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, b, hk, m, d, g = "cuda", 2, 8, 4, 128, 64
    rows = []
    for kind in ("gaussian", "outliers", "odd_planes_large", "even_planes_large"):
        for ks in args.logit_scale:
            gen = torch.Generator().manual_seed(len(kind) * 100 + int(ks * 10))
            q = queries(kind, b, hk, m, d, gen)
            kf = torch.randn(b, hk, args.n, d, generator=gen) * ks
            vf = torch.randn(b, hk, args.n, d, generator=gen)
            k, v = quantize_rows(kf, g, 1.0, torch.bfloat16), quantize_rows(vf, g, 1.0, torch.bfloat16)
            cu = lambda r: QuantizedRows(*(t.to(dev) for t in r))  # noqa: E731
            start = torch.zeros(b, dtype=torch.long, device=dev)
            call = (q.to(dev), cu(k), cu(v), start, None, None, d**-0.5, g)
            rm, rl, ra = history_partial_reference(*call, 4096)
            ref_o = ra / rl[..., None]
            # the INT2 cache's own error: exact attention on the float keys / values (in the rotated space, as here)
            p = torch.softmax((q.double() @ kf.double().transpose(-1, -2)) * d**-0.5, -1)
            exact = p @ vf.double()
            row = {"queries": kind, "key_scale": ks, "int2_cache_vs_exact": rel(ref_o.cpu(), exact)}
            for name, cfg in PATHS.items():
                pm, pl, pa = dt._launch(*call, cfg={**dt.CONFIG, "gluon": 1, "gluon_min_work": 0, **cfg})
                row[name] = rel(pa / pl[..., None], ref_o)
                row[name + "_dlse"] = ((pm + torch.log(pl)) - (rm + torch.log(rl))).abs().max().item()
            rows.append(row)
            print(" ".join(f"{k_}={v_:.2e}" if isinstance(v_, float) else f"{k_}={v_}" for k_, v_ in row.items()),
                  flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "n": args.n, "shape": [b, hk, m, d, g], "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
