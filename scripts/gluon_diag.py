"""Diagnostics of the Gluon history kernel against the reference, piece by piece (GPU): per-plane output errors,
the log-sum-exp, and crafted inputs that isolate the key planes, the key bias, the value planes and the value
offsets. Prints one line per case."""
from __future__ import annotations

import sys

import torch

from oscar_hf.kernels import decode_triton as dt
from oscar_hf.kernels.int2_attention import history_partial_reference
from oscar_hf.quant import QuantizedRows, quantize_rows


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run(name, q, k, v, start, off, g=64):
    d = q.shape[-1]
    args = (q, k, v, start, None, off, d**-0.5, g)
    ref = history_partial_reference(*args, 4096)
    got = dt._launch(*args, cfg={**dt.CONFIG, "gluon": 1})
    tri = dt._launch(*args, cfg={**dt.CONFIG, "gluon": 0})
    out = []
    for lab, p in (("glu", got), ("tri", tri)):
        m, l, acc = p
        rm, rl, ra = ref
        lse = (m + torch.log(l)) - (rm + torch.log(rl))
        o = acc / l[..., None]
        ro = ra / rl[..., None]
        planes = " ".join(f"{rel(o[..., 32 * i:32 * i + 32], ro[..., 32 * i:32 * i + 32]):.3f}" for i in range(4))
        out.append(f"{lab}: dlse {lse.abs().max().item():.2e} dm {(m - rm).abs().max().item():.2e} planes {planes}")
    print(f"{name:28s} | " + " | ".join(out), flush=True)


def main():
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    for m_rows in (4, 6):
        for n in (32, 64, 1000):
            b, hk, d, g = 1, 1, 128, 64
            q = torch.randn(b, hk, m_rows, d, generator=gen)
            kf = torch.randn(b, hk, n, d, generator=gen) * 2
            vf = torch.randn(b, hk, n, d, generator=gen)
            start = torch.zeros(b, dtype=torch.long, device=dev)
            k = quantize_rows(kf, g, 1.0, torch.bfloat16)
            v = quantize_rows(vf, g, 1.0, torch.bfloat16)
            cu = lambda r: QuantizedRows(*(t.to(dev) for t in r))  # noqa: E731
            run(f"M{m_rows} n{n} random", q.to(dev), cu(k), cu(v), start, None)
            # values: all codes 0, scale 0: output = zero (per group) -> tests l and sum p z
            v0 = QuantizedRows(torch.zeros_like(v.codes), torch.zeros_like(v.scale), v.zero)
            run(f"M{m_rows} n{n} v=zero only", q.to(dev), cu(k), cu(v0), start, None)
            # keys: codes 0, scale 0 -> logits = z . Qs (bias only)
            k0 = QuantizedRows(torch.zeros_like(k.codes), torch.zeros_like(k.scale), k.zero)
            run(f"M{m_rows} n{n} k=zero only", q.to(dev), cu(k0), cu(v), start, None)
            # query in one plane only
            for p in range(4):
                qp = torch.zeros_like(q)
                qp[..., 32 * p:32 * p + 32] = q[..., 32 * p:32 * p + 32] * 3
                run(f"M{m_rows} n{n} q plane {p}", qp.to(dev), cu(k), cu(v), start, None)
            # offsets
            run(f"M{m_rows} n{n} qk_offset", q.to(dev), cu(k), cu(v), start,
                torch.randn(b, hk, m_rows, generator=gen).to(dev) * 3)
            # value codes of one plane only (others 0), zero 0
            for p in range(4):
                codes = v.codes.clone()
                mask = 3 << (2 * p)
                codes &= mask
                vp = QuantizedRows(codes, v.scale, torch.zeros_like(v.zero))
                run(f"M{m_rows} n{n} v plane {p}", q.to(dev), cu(k), cu(vp), start, None)


if __name__ == "__main__":
    sys.exit(main())
