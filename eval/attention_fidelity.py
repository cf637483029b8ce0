"""Per-layer attention fidelity of a KV method: KL(attn_full || attn_quantized) and the relative error
of the attention output, as a function of context length.

One full-precision forward captures every layer's post-RoPE ``q, k, v``; each method's fake-quant spec
(:mod:`oscar_hf.eval.methods`) then gives the keys/values a decode query at position ``p`` would read
(full precision where ``exact_mask`` says so, the quantized reconstruction elsewhere). Errors are
per layer on the SAME inputs (no propagation through earlier layers), averaged over heads and the
``n_queries`` positions just before each context length.

    python -m oscar_hf.eval.attention_fidelity --lengths 512,1024,2048
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from oscar_hf.patching import patched, register_handler

_CAPTURE: dict | None = None


def _capture_handler(module, query, key, value, attention_mask, *args, base, **kwargs):
    if _CAPTURE is not None and isinstance(key, torch.Tensor):
        _CAPTURE[module.layer_idx] = (query.detach().float(), key.detach().float(), value.detach().float(),
                                      kwargs.get("scaling") or query.shape[-1] ** -0.5)
    return NotImplemented


register_handler("oscarcap_", _capture_handler)


@torch.no_grad()
def capture_qkv(model, ids: torch.Tensor) -> dict:
    """``{layer: (q [1, Hq, n, D], k [1, Hk, n, D], v, scaling)}`` from one full-precision forward."""
    global _CAPTURE
    _CAPTURE = {}
    try:
        with patched(model, "oscarcap_"):
            model(ids.reshape(1, -1).to(next(model.parameters()).device), use_cache=False)
        return _CAPTURE
    finally:
        _CAPTURE = None


@torch.no_grad()
def layer_errors(q, k, v, scaling, k_hat, v_hat, exact_row: torch.Tensor, positions) -> tuple[float, float]:
    """Mean KL and relative output error over ``positions`` (query indices) and query heads."""
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    kl_s, err_s = 0.0, 0.0
    for p in positions:
        qp = q[0, :, p]  # [Hq, D]
        kk = k[0, :, : p + 1].repeat_interleave(g, 0)  # [Hq, p+1, D]
        vv = v[0, :, : p + 1].repeat_interleave(g, 0)
        ex = exact_row[p, : p + 1]
        kq = torch.where(ex[None, :, None], kk, k_hat[0, :, : p + 1].repeat_interleave(g, 0))
        vq = torch.where(ex[None, :, None], vv, v_hat[0, :, : p + 1].repeat_interleave(g, 0))
        lp = torch.log_softmax(torch.einsum("hd,hnd->hn", qp, kk) * scaling, -1)
        lq = torch.log_softmax(torch.einsum("hd,hnd->hn", qp, kq) * scaling, -1)
        kl_s += (lp.exp() * (lp - lq)).sum(-1).mean().item()
        o = torch.einsum("hn,hnd->hd", lp.exp(), vv)
        oq = torch.einsum("hn,hnd->hd", lq.exp(), vq)
        err_s += ((oq - o).norm(dim=-1) / o.norm(dim=-1).clamp_min(1e-12)).mean().item()
    return kl_s / len(positions), err_s / len(positions)


def fidelity(model, ids: torch.Tensor, methods: dict, lengths=(512, 1024, 2048), n_queries: int = 32,
             progress: bool = True) -> dict:
    """``{method: {length: {"kl": [per layer], "rel_err": [per layer]}}}``."""
    from tqdm.auto import tqdm

    n = max(lengths)
    cap = capture_qkv(model, ids[:n])
    out = {}
    for name, method in methods.items():
        spec = method.fake_spec(model)
        exact = spec.exact_mask(n, 1, "cpu")
        res = {L: {"kl": [], "rel_err": []} for L in lengths}
        for i in tqdm(sorted(cap), desc=f"fidelity {name}", disable=not progress, leave=False):
            q, k, v, sc = cap[i]
            fq = spec.layer_kv(i, k, v)
            k_hat, v_hat = fq if fq is not None else (k, v)
            for L in lengths:
                kl, err = layer_errors(q, k, v, sc, k_hat, v_hat, exact, range(L - n_queries, L))
                res[L]["kl"].append(kl)
                res[L]["rel_err"].append(err)
        out[name] = res
    return out


def plot_fidelity(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name, res in results.items():
        lengths = sorted(res, key=int)
        top = res[lengths[-1]]
        axes[0].semilogy(top["kl"], label=name)
        axes[1].plot(top["rel_err"], label=name)
        axes[2].semilogy([int(L) for L in lengths], [sum(res[L]["kl"]) / len(res[L]["kl"]) for L in lengths], "o-", label=name)
    axes[0].set(xlabel="layer", ylabel="KL(full || quantized), nats", title=f"per layer, context {lengths[-1]}")
    axes[1].set(xlabel="layer", ylabel="relative output error", title=f"per layer, context {lengths[-1]}")
    axes[2].set(xlabel="context length", ylabel="mean KL over layers", title="vs context length")
    axes[2].set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    import argparse

    from oscar_hf.models import load_model

    from .compare import find_artifact, swap_rotation
    from .methods import OscarFamily, get_method
    from .perplexity import evaluation_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,2048")
    p.add_argument("--queries", type=int, default=32)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    model, tok = load_model("smollm2", dtype=torch.float32)
    W = dict(sink=64, recent=256, group_size=64)
    methods = {"naive INT2": get_method("identity", **W), "Hadamard": get_method("hadamard", **W),
               "KIVI-2": get_method("kivi", group_size=64, residual=128), "Turbo 3-bit": get_method("turbo", bits=3)}
    osc = find_artifact("oscar", 64)
    if osc is not None:
        methods["Hadamard + centering"] = OscarFamily("hc", rotations=swap_rotation(osc, "hadamard"), **W)
        methods["OSCAR"] = OscarFamily("oscar", rotations=osc, center=False, **W)
        methods["OSCAR + centering"] = OscarFamily("oscar-c", rotations=osc, **W)
    pca = find_artifact("pca-kv", 64)
    if pca is not None:
        methods["raw PCA"] = OscarFamily("pca", rotations=pca, center=False, **W)
    ids = evaluation_ids(tok, max(lengths))
    res = fidelity(model, ids, methods, lengths, args.queries)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_fidelity.json").write_text(json.dumps(res, indent=1))
    plot_fidelity(res, out / "attention_fidelity.png")
    for name, r in res.items():
        print(f"{name:22s} " + "  ".join(f"L={L}: KL {sum(r[L]['kl']) / len(r[L]['kl']):.4f} err {sum(r[L]['rel_err']) / len(r[L]['rel_err']):.3f}"
                                         for L in lengths))


if __name__ == "__main__":
    main()
