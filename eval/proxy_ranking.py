"""Which calibration-time error predicts perplexity? Proxies against fake-quant perplexity over rotation choices.

Calibration picks rotations by an error it can measure cheaply on held-out calibration tokens; a proxy is worth
using for that choice only if it orders the candidates as end-to-end perplexity does. This runs a set of cache
configurations (rotation x centering, everything else the library's defaults, no retrieval heads, so that only
the INT2 rows differ) and, for each, four proxies on calibration text and the perplexity change on held-out text:

* ``attention``: the library's selection objective (:func:`oscar_hf.calibration.search.attention_error`, the mean
  over layers of the relative key-logit error plus the relative attention-output error, only the (query, key) pairs
  the cache quantizes);
* ``output``: the relative error of each layer's attention output per query head (:mod:`.attention_fidelity`);
* ``o_proj``: the same error after the layer's ``o_proj``, i.e. in the residual stream (what the next layer reads);
* ``kl``: teacher-forced KL(BF16 || quantized) of the next-token distributions (one fake-quantized forward).

The last three are computed layer by layer on the *same* captured ``q, k, v`` (no propagation) except ``kl``, which
is end to end. Output: Spearman's rank correlation of each proxy with each text's perplexity change.

    python -P -m oscar_hf.eval.proxy_ranking --oscar /tmp/smollm2-default --pca-kv /tmp/smollm2-pca-kv \
        --auto /tmp/smollm2-auto --name proxy_ranking_smollm2_cpu
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from .attention_fidelity import capture_qkv, layer_errors


def spearman(a, b) -> float:
    """Spearman's rank correlation of two equal-length sequences (average ranks for ties)."""
    def ranks(x):
        x = torch.as_tensor(x, dtype=torch.float64)
        order = x.argsort()
        r = torch.empty_like(x)
        r[order] = torch.arange(len(x), dtype=torch.float64)
        for v in x.unique():  # ties share their mean rank
            m = x == v
            r[m] = r[m].mean()
        return r

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-300))


@torch.no_grad()
def output_errors(model, cap: dict, spec, positions) -> tuple[float, float]:
    """Mean over layers of the relative attention-output error per query head, before and after ``o_proj``, at the
    query ``positions`` (``cap``: :func:`capture_qkv`; ``spec``: a fake-quant spec; exact positions as the cache)."""
    exact = spec.exact_mask(max(positions) + 1, 1, "cpu")
    out_err, proj_err = [], []
    for i in sorted(cap):
        q, k, v, sc = cap[i]
        fq = spec.layer_kv(i, k, v)
        k_hat, v_hat = fq if fq is not None else (k, v)
        w_o = model.model.layers[i].self_attn.o_proj.weight
        _, e_out, e_proj = layer_errors(q, k, v, sc, k_hat, v_hat, exact, positions, w_o=w_o)
        out_err.append(e_out)
        proj_err.append(e_proj)
    return sum(out_err) / len(out_err), sum(proj_err) / len(proj_err)


@torch.no_grad()
def full_log_probs(model, ids: torch.Tensor) -> torch.Tensor:
    """``[1, n, vocab]`` float32 next-token log-probabilities of the plain model over ``ids [n]`` (the reference of
    :func:`fake_quant_kl`, computed once for every configuration)."""
    x = ids.reshape(1, -1).to(next(model.parameters()).device)
    return torch.log_softmax(model(x, use_cache=False).logits.float(), -1)


@torch.no_grad()
def fake_quant_kl(model, ids: torch.Tensor, spec, reference: torch.Tensor | None = None) -> float:
    """Mean teacher-forced KL(full || fake-quantized) of the next-token distributions over ``ids`` (one forward
    through ``spec``; the calibration's own check, ``oscar_hf.calibration.selection``, goes through the cache).
    ``reference``: :func:`full_log_probs` of ``ids``."""
    from .fakequant import fake_quant

    ref = reference if reference is not None else full_log_probs(model, ids)
    x = ids.reshape(1, -1).to(next(model.parameters()).device)
    with fake_quant(model, spec):
        got = torch.log_softmax(model(x, use_cache=False).logits.float(), -1)
    return float((ref.exp() * (ref - got)).sum(-1).mean())


def configurations(model, artifacts: dict, window: dict) -> dict:
    """``{label: OscarFamily}``: built-in identity / Hadamard and each given artifact, with and without centering;
    no retrieval heads."""
    from oscar_hf import OscarRotations

    from .compare import swap_rotation
    from .methods import OscarFamily

    kw = dict(window, retrieval_heads=0)
    out = {"identity": OscarFamily("identity", rotations=OscarRotations.builtin(model, "identity"), **kw),
           "Hadamard": OscarFamily("hadamard", rotations=OscarRotations.builtin(model, "hadamard"), **kw)}
    if "oscar" in artifacts:
        osc = artifacts["oscar"]
        out["identity + centering"] = OscarFamily("ic", rotations=swap_rotation(osc, "identity", clip=None), **kw)
        out["Hadamard + centering"] = OscarFamily("hc", rotations=swap_rotation(osc, "hadamard", clip=None), **kw)
    for name, rot in artifacts.items():
        out[name] = OscarFamily(name, rotations=rot, center=False, **kw)
        out[f"{name} + centering"] = OscarFamily(f"{name}-c", rotations=rot, **kw)
    return out


def main(argv=None, model=None, tokenizer=None):
    import argparse
    import time

    from tqdm.auto import tqdm

    from oscar_hf import OscarRotations
    from oscar_hf.calibration.search import attention_error
    from oscar_hf.data import calibration_text, tokenize
    from oscar_hf.eval.models import model_for_eval, wikitext_path

    from .default_perplexity import load_ids
    from .methods import get_method
    from .perplexity import perplexity

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("oscar", "pca-kv", "auto"):
        p.add_argument(f"--{name}", default=None, help=f"artifact calibrated with method={name!r}")
    p.add_argument("--proxy-offset", type=int, default=20000,
                   help="calibration-text token where the proxies' 2048 tokens start (past the statistics windows)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--windows", type=int, default=4, help="perplexity windows per text")
    p.add_argument("--queries", type=int, default=32, help="query positions per layer for output / o_proj")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="proxy_ranking")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer, model_name, dtype = model_for_eval(model, tokenizer, getattr(torch, args.dtype))
    artifacts = {n: OscarRotations.from_pretrained(getattr(args, n.replace("-", "_")))
                 for n in ("oscar", "pca-kv", "auto") if getattr(args, n.replace("-", "_"))}
    window = dict(sink=64, recent=256, group_size=64)
    configs = configurations(model, artifacts, window)
    n = 2048
    cal = tokenize(tokenizer, calibration_text(wikitext_path()), args.proxy_offset + n)
    if len(cal) < args.proxy_offset + n:
        raise ValueError(f"calibration text has {len(cal)} tokens; lower --proxy-offset")
    proxy_ids = torch.as_tensor(cal[args.proxy_offset:]).reshape(-1)
    cap = capture_qkv(model, proxy_ids)
    ref = full_log_probs(model, proxy_ids)
    positions = range(n - args.queries, n)
    texts = ("wikitext", "pydoc")
    eval_ids = {t: load_ids(tokenizer, t, args.context * args.windows) for t in texts}
    fp = {t: perplexity(model, eval_ids[t], get_method("fp"), context_len=args.context, n_windows=args.windows,
                        progress=False)["ppl"] for t in texts}
    rows = {}
    for label, method in tqdm(configs.items(), desc="configurations"):
        t0 = time.perf_counter()
        spec = method.fake_spec(model)
        att = attention_error(model, method.rotations, proxy_ids.reshape(1, -1), group_size=64,
                              center=method.config.center)
        out_e, proj_e = output_errors(model, cap, spec, positions)
        row = dict(attention=att["total"], output=out_e, o_proj=proj_e, kl=fake_quant_kl(model, proxy_ids, spec, ref))
        for t in texts:
            r = perplexity(model, eval_ids[t], method, context_len=args.context, n_windows=args.windows,
                           progress=False)
            row[f"ppl_{t}"] = r["ppl"]
            row[f"delta_{t}"] = r["ppl"] / fp[t] - 1
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows[label] = row
        print(label, {k: round(v, 5) for k, v in row.items()}, flush=True)
    proxies = ("attention", "output", "o_proj", "kl")
    rho = {px: {t: spearman([r[px] for r in rows.values()], [r[f"delta_{t}"] for r in rows.values()])
                for t in texts} for px in proxies}
    command = "python -P -m oscar_hf.eval.proxy_ranking " + " ".join(argv if argv is not None else sys.argv[1:])
    res = dict(command=command, setup=dict(model=model_name, dtype=str(dtype).removeprefix("torch."), window=window, proxy_tokens=n,
                                           proxy_offset=args.proxy_offset, context=args.context,
                                           windows=args.windows, bf16_ppl=fp, queries=args.queries,
                                           artifacts={k: getattr(args, k.replace("-", "_")) for k in artifacts}),
               rows=rows, spearman=rho)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    md = [f"Command: `{command}`\n", "| configuration | attention | output | o_proj | KL | WikiText | pydoc |",
          "|---|---|---|---|---|---|---|"]
    for label, r in sorted(rows.items(), key=lambda kv: kv[1]["delta_wikitext"]):
        md.append(f"| {label} | {r['attention']:.4f} | {r['output']:.4f} | {r['o_proj']:.4f} | {r['kl']:.4f} | "
                  f"{100 * r['delta_wikitext']:+.2f}% | {100 * r['delta_pydoc']:+.2f}% |")
    md += ["", "Spearman's rank correlation of each proxy with the perplexity change (1: the same order):", "",
           "| proxy | WikiText | pydoc |", "|---|---|---|"]
    md += [f"| {px} | {rho[px]['wikitext']:+.3f} | {rho[px]['pydoc']:+.3f} |" for px in proxies]
    (out / f"{args.name}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))



if __name__ == "__main__":
    main()
