"""Per-layer attention fidelity of a KV method: KL(attn_full || attn_quantized) and the relative error
of the attention output, as a function of context length.

One full-precision forward captures every layer's post-RoPE ``q, k, v``; each method's fake-quant spec
(:mod:`oscar_hf.eval.methods`) then gives the keys/values a decode query at position ``p`` would read
(full precision where ``exact_mask`` says so, the quantized reconstruction elsewhere). Errors are
per layer on the SAME inputs (no propagation through earlier layers), averaged over heads and the
``n_queries`` positions just before each context length.

    python -P scripts/eval_attention_fidelity.py --lengths 512,1024,2048,4096,8192
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
def layer_errors(q, k, v, scaling, k_hat, v_hat, exact_row: torch.Tensor, positions, w_o=None):
    """Mean KL and relative output error over ``positions`` (query indices) and query heads; with ``w_o`` (the
    layer's ``o_proj`` weight ``[hidden, Hq * D]``) also the relative error of each head's share of the residual
    update, ``o_h W_o[:, h]ᵀ``, as a third value."""
    hq, hk = q.shape[1], k.shape[1]
    g = hq // hk
    kl_s, err_s, proj_s = 0.0, 0.0, 0.0
    wh = None if w_o is None else w_o.float().view(w_o.shape[0], hq, q.shape[-1])  # [hidden, Hq, D]
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
        if wh is not None:
            r, rq = torch.einsum("hd,khd->hk", o, wh), torch.einsum("hd,khd->hk", oq, wh)
            proj_s += ((rq - r).norm(dim=-1) / r.norm(dim=-1).clamp_min(1e-12)).mean().item()
    n = len(positions)
    return (kl_s / n, err_s / n) if wh is None else (kl_s / n, err_s / n, proj_s / n)


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
    """Per-layer KL and relative output error at the longest context, and both (mean over layers) vs context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for name, res in results.items():
        lengths = sorted(res, key=int)
        top = res[lengths[-1]]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        line = axes[0].semilogy(top["kl"], label=name)[0]
        axes[1].semilogy(top["rel_err"], color=line.get_color())
        axes[2].loglog([int(L) for L in lengths], [mean(res[L]["kl"]) for L in lengths], "o-", color=line.get_color())
        axes[3].semilogx([int(L) for L in lengths], [mean(res[L]["rel_err"]) for L in lengths], "o-",
                         color=line.get_color())
    axes[0].set(xlabel="layer", ylabel="KL(full || quantized), nats", title=f"per layer, context {lengths[-1]}")
    axes[1].set(xlabel="layer", ylabel="relative output error", title=f"per layer, context {lengths[-1]}")
    axes[2].set(xlabel="context length", ylabel="mean KL over layers", title="KL vs context length")
    axes[3].set(xlabel="context length", ylabel="mean relative output error", title="output error vs context length")
    axes[2].set_xscale("log", base=2)
    axes[3].set_xscale("log", base=2)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(results: dict) -> str:
    """Markdown: mean over layers of KL and relative output error per method and context length."""
    names = list(results)
    lengths = sorted(results[names[0]], key=int)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    head = "| method | " + " | ".join(f"KL @{L}" for L in lengths) + " | " + " | ".join(f"err @{L}" for L in lengths) + " |"
    lines = [head, "|---" * (1 + 2 * len(lengths)) + "|"]
    for n in names:
        r = results[n]
        lines.append(f"| {n} | " + " | ".join(f"{mean(r[L]['kl']):.4f}" for L in lengths) + " | "
                     + " | ".join(f"{mean(r[L]['rel_err']):.3f}" for L in lengths) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    import argparse
    import sys

    from oscar_hf.eval.models import load_model

    from .compare import find_artifact, swap_rotation
    from .methods import OscarFamily, get_method
    from .perplexity import evaluation_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,1024,2048")
    p.add_argument("--queries", type=int, default=32)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = tuple(int(x) for x in args.lengths.split(","))
    model, tok = load_model("smollm2", dtype=torch.float32)
    W = dict(sink=64, recent=256, group_size=64)
    methods = {"naive INT2": get_method("identity", **W), "Hadamard": get_method("hadamard", **W)}
    osc = find_artifact("oscar", 64)
    pca = find_artifact("pca-kv", 64)
    if osc is not None:
        methods["naive INT2 + centering"] = OscarFamily("ic", rotations=swap_rotation(osc, "identity"), **W)
        methods["Hadamard + centering"] = OscarFamily("hc", rotations=swap_rotation(osc, "hadamard"), **W)
    if pca is not None:
        methods["raw K/V PCA"] = OscarFamily("pca", rotations=pca, center=False, **W)
        methods["raw K/V PCA + centering"] = OscarFamily("pca-c", rotations=pca, **W)
    if osc is not None:
        methods["OSCAR"] = OscarFamily("oscar", rotations=osc, center=False, **W)
        methods["OSCAR + centering"] = OscarFamily("oscar-c", rotations=osc, **W)
    methods["KIVI-2"] = get_method("kivi", group_size=64, residual=128)
    methods["Turbo 3-bit"] = get_method("turbo", bits=3)
    ids = evaluation_ids(tok, max(lengths))
    res = fidelity(model, ids, methods, lengths, args.queries)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -P scripts/eval_attention_fidelity.py " + " ".join(argv if argv is not None else sys.argv[1:])
    setup = dict(model="SmolLM2-135M float32", text="WikiText-2 held-out half (evaluation_ids)", window=W,
                 queries_per_length=args.queries, artifacts={"oscar": osc.metadata.get("path") if osc else None,
                                                             "pca-kv": pca.metadata.get("path") if pca else None},
                 note="per layer on the same captured q/k/v (no error propagation), mean over query heads and the "
                      "last `queries` positions before each length")
    (out / "attention_fidelity.json").write_text(json.dumps(dict(command=command, setup=setup, results=res), indent=1))
    plot_fidelity(res, out / "attention_fidelity.png")
    table = summary_table(res)
    (out / "attention_fidelity.md").write_text(f"# Attention fidelity (SmolLM2-135M)\n\nCommand: `{command}`\n\n"
                                               "Mean over the 30 layers.\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
