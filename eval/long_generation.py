"""How far a long self-generated continuation drifts from BF16 when the history is read from a quantized cache.

The reference model (no quantization) continues each prompt by ``n_tokens`` tokens (its own output: what the INT2
history holds while a model reasons at length; :mod:`oscar_hf.eval.continuations`): greedy, or sampled with a fixed
seed per prompt (``--sample``: it does not loop as a small model's greedy text does; ``distinct_4grams`` says how much
each continuation repeats), after held-out text windows or instructions about them through the chat template
(``--chat``). It is generated once, so every method reads the same tokens, teacher-forced, each continuation token
predicted by a decode step of the method's cache, as in :mod:`oscar_hf.eval.perplexity`:
one fake-quantized forward (``fast``, proven equal to token-by-token decoding in ``tests/eval/test_perplexity.py``)
or the real cache token by token (``exact``; Transformers' ``QuantizedCache`` rows always). Per continuation
position ``i`` (0 = the first generated token): ``KL(reference || method)`` of the next-token distributions and
whether their top-1 tokens agree, then means per position bucket over all prompts.

    python -P scripts/eval_long_generation.py --artifact /tmp/smollm2-default --tokens 2048 --prompts 2 --threads 1 \\
        --name long_generation_smollm2_cpu
    python -P scripts/eval_long_generation.py --model gemma3-270m --artifact oscar_hf/pretrained/gemma-3-270m --chat \\
        --sample --tokens 1024 --prompts 3 --methods default,hadamard,kivi,bf16-kv --name long_generation_chat_gemma3_cpu
"""
from __future__ import annotations

import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from oscar_hf.config import ModelFingerprint

from .continuations import GEMMA3_CHAT_TEMPLATE, Sampling, chat_prompts, continuation, distinct_ngrams, stop_ids
from .methods import KVMethod, get_method, with_label
from .perplexity import _bar_disabled, decode_logits, fast_logits

BUCKET_EDGES = (0, 512, 1024, 2048, 4096)
UNQUANTIZED = ("fp", "bf16-kv")  # CLI rows that keep every K/V in BF16: not baselines of the target


def prompt_windows(tokenizer, source, prompt_len: int, n_prompts: int, **load_kw) -> torch.Tensor:
    """``[n_prompts, prompt_len]`` consecutive token windows of ``source``'s held-out evaluation text (a text /
    JSONL file or a ``datasets`` name, :func:`oscar_hf.data.load_texts`; never read by calibration)."""
    from oscar_hf.data import evaluation_text, token_windows

    if prompt_len < 1 or n_prompts < 1:
        raise ValueError(f"prompt_len and n_prompts must be >= 1, got {prompt_len}, {n_prompts}")
    return token_windows(tokenizer, evaluation_text(source, **load_kw), prompt_len, n_prompts)


def _uses_cache(method: KVMethod, exact: bool) -> bool:
    """Token by token through the real cache: asked for (``exact``) and the method has one, or it has no one-forward
    equivalent (Transformers' ``QuantizedCache``)."""
    return not method.fast or (exact and type(method).make_cache is not KVMethod.make_cache)


def position_logits(model, ids: torch.Tensor, prompt_len: int, method: KVMethod, spec, exact: bool,
                    progress: bool = True) -> torch.Tensor:
    """``[n - prompt_len, V]`` logits (model dtype) of ``method`` predicting ``ids[0, prompt_len:]`` (``ids`` ``[1, n]``);
    ``spec``: ``method.fake_spec(model)``, built once per method (unused on the token-by-token path)."""
    ids = ids.to(next(model.parameters()).device)
    if _uses_cache(method, exact):
        steps = decode_logits(model, ids, prompt_len, method.make_cache(model), progress, method.name)
        return torch.cat(list(steps))
    return fast_logits(model, ids, prompt_len, spec)[0]


@torch.no_grad()
def kl_and_agreement(ref_logits: torch.Tensor, logits: torch.Tensor, chunk: int = 512):
    """``KL(softmax(ref) || softmax(logits))`` (nats, float64 ``[N]``) and top-1 agreement (bool ``[N]``) per row of
    two ``[N, V]`` logit tensors, ``chunk`` rows at a time in float32 (bounded memory at a 49K vocabulary)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logits shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    kl, agree = [], []
    for a in range(0, ref_logits.shape[0], chunk):
        r, m = ref_logits[a : a + chunk].float(), logits[a : a + chunk].float()
        lp, lq = F.log_softmax(r, -1), F.log_softmax(m, -1)
        kl.append((lp.exp() * (lp - lq)).sum(-1).double().cpu())
        agree.append((r.argmax(-1) == m.argmax(-1)).cpu())
    return torch.cat(kl), torch.cat(agree)


def buckets(n: int, edges: Sequence[int] = BUCKET_EDGES) -> list[tuple[int, int]]:
    """``[start, end)`` position buckets covering ``[0, n)``: ``edges`` below ``n``, the last bucket ending at ``n``."""
    if n <= 0:
        raise ValueError(f"n must be > 0, got {n}")
    cuts = sorted({0, n, *(e for e in edges if 0 < e < n)})
    return list(zip(cuts[:-1], cuts[1:]))


def bucket_means(values: torch.Tensor, edges: Sequence[int] = BUCKET_EDGES) -> list[dict]:
    """Mean of ``values`` ``[P, N]`` (prompts x positions) over every prompt and the positions of each bucket."""
    v = values.double().reshape(-1, values.shape[-1])
    return [dict(start=a, end=b, mean=v[:, a:b].mean().item()) for a, b in buckets(v.shape[1], edges)]


def long_generation(model, prompts, methods: Sequence[KVMethod | str], n_tokens: int, exact: bool = False,
                    edges: Sequence[int] = BUCKET_EDGES, progress: bool = True, sampling: Sampling | None = None,
                    banned: Sequence[int] | None = None) -> dict:
    """Drift of each method from the plain model along the model's own continuation of every prompt (greedy, or
    ``sampling``; ``banned``: :func:`continuation`'s).

    ``prompts`` ``[P, L]`` or a list of ``[L_i]``; ``methods``: :class:`~oscar_hf.eval.methods.KVMethod` rows or registered names (rows are
    keyed by ``method.name``); ``exact``: every method with a real cache read token by token (the reference too:
    a ``DynamicCache``), else the one-forward path where a method has one. Returns ``ids`` (``[L_i + N]`` per prompt),
    ``prompt_lens``, ``distinct_4grams`` per continuation, ``reference_agreement`` (share of positions where the
    reference's top-1 is the generated token: greedy, 1 but for near-ties between the generating and the scoring
    path; sampled, how often the draw was the top-1) and per row ``kl`` / ``agreement`` (float64
    ``[P, N]``, agreement 1.0 or 0.0), their bucket means (``buckets``), overall means, ``path`` and ``seconds``.
    """
    rows = [get_method(m) if isinstance(m, str) else m for m in methods]
    for m in rows:
        if not isinstance(m, KVMethod):
            raise ValueError(f"methods must be KVMethods or registered names, got {type(m).__name__}")
    if len({m.name for m in rows}) != len(rows):
        raise ValueError(f"method names must be unique, got {[m.name for m in rows]}")
    if isinstance(prompts, torch.Tensor) and prompts.dim() != 2:
        raise ValueError(f"prompts must be [P, L] or a list of [L_i], got {tuple(prompts.shape)}")
    if any(p.dim() != 1 or p.numel() == 0 for p in prompts):
        raise ValueError("every prompt must be a non-empty [L_i] id tensor")
    seqs = continuation(model, prompts, n_tokens, sampling, banned, progress)
    lens = [p.shape[0] for p in prompts]
    ref, specs = get_method("fp"), {m.name: None if _uses_cache(m, exact) else m.fake_spec(model) for m in rows}
    kl = {m.name: [] for m in rows}
    agree = {m.name: [] for m in rows}
    seconds = dict.fromkeys(kl, 0.0)
    ref_agree = []
    for x, L in tqdm(list(zip(seqs, lens)), desc="prompts", disable=_bar_disabled(progress), leave=False):
        x = x[None]  # [1, L + N]
        ref_logits = position_logits(model, x, L, ref, None, exact, progress)
        ref_agree.append((ref_logits.argmax(-1).cpu() == x[0, L:]).double().mean().item())
        for m in rows:
            t0 = time.perf_counter()
            k, a = kl_and_agreement(ref_logits, position_logits(model, x, L, m, specs[m.name], exact, progress))
            kl[m.name].append(k)
            agree[m.name].append(a)
            seconds[m.name] += time.perf_counter() - t0
    res = {"ids": seqs, "prompt_lens": lens, "n_tokens": n_tokens, "reference_agreement": ref_agree,
           "distinct_4grams": [distinct_ngrams(x[L:]) for x, L in zip(seqs, lens)],
           "sampling": None if sampling is None else vars(sampling), "rows": {}}
    for m in rows:
        k, a = torch.stack(kl[m.name]), torch.stack(agree[m.name]).double()  # [P, N]
        res["rows"][m.name] = dict(
            kl=k, agreement=a, kl_mean=k.mean().item(), agreement_mean=a.mean().item(),
            buckets=[dict(start=bk["start"], end=bk["end"], kl=bk["mean"], agreement=ba["mean"])
                     for bk, ba in zip(bucket_means(k, edges), bucket_means(a, edges))],
            path="token-by-token" if _uses_cache(m, exact) else "fast", seconds=round(seconds[m.name], 1),
            settings=m.settings())
    return res


# ------------------------------------------------------------------------------------------ report
def _span(a: int, b: int) -> str:
    f = lambda x: f"{x // 1024}K" if x and x % 1024 == 0 else str(x)  # noqa: E731
    return f"{f(a)}-{f(b)}"


def markdown(res: dict) -> str:
    """Per method: mean KL (nats) and top-1 agreement with the reference in each position bucket."""
    rows = res["rows"]
    spans = [_span(b["start"], b["end"]) for b in next(iter(rows.values()))["buckets"]]
    lines = ["| method | bits @end | " + " | ".join(f"{s} KL | {s} top-1" for s in spans) + " | all KL | all top-1 |",
             "|---" * (2 * len(spans) + 4) + "|"]
    for name, r in rows.items():
        cells = [f"{b['kl']:.4f} | {b['agreement']:.3f}" for b in r["buckets"]]
        bits = f"{r['bits']:.2f}" if "bits" in r else "—"
        lines.append(f"| {name} | {bits} | " + " | ".join(cells) + f" | {r['kl_mean']:.4f} | {r['agreement_mean']:.3f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path, smooth: int = 128) -> None:
    """KL and top-1 agreement over continuation position per method (mean over prompts, moving average of ``smooth``
    positions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax_kl, ax_ag) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
    for name, r in res["rows"].items():
        for ax, key in ((ax_kl, "kl"), (ax_ag, "agreement")):
            y = r[key].mean(0).numpy()  # [N]: mean over prompts
            w = min(smooth, len(y))
            ys = np.convolve(y, np.ones(w) / w, mode="valid")
            ax.plot(np.arange(len(ys)) + w // 2, ys, label=name, lw=1.2)
    ax_kl.set_yscale("log")
    ax_kl.set_ylabel("KL(reference || method), nats")
    ax_ag.set_ylabel("top-1 agreement with the reference")
    ax_ag.set_xlabel(f"continuation position (generated token; moving average of {smooth})")
    ax_kl.legend(fontsize=7)
    how = "greedy" if res["sampling"] is None else "sampled"
    ax_kl.set_title(f"{res.get('model', 'model')}: {len(res['prompt_lens'])} prompts of {min(res['prompt_lens'])}-"
                    f"{max(res['prompt_lens'])} tokens + {res['n_tokens']} {how} tokens", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ CLI
def method_rows(names: Sequence[str], artifact: str | None, model) -> list[KVMethod]:
    """The CLI's rows by short name. ``default``: ``OscarCache.from_pretrained(artifact, model)``'s configuration
    (calibrated rotations, ``retrieval_heads="auto"``); the others: the ≤3-bit rows of ``eval/compare.py`` and
    ``bf16-kv``, the reference's own K/V through the fake-quant path (its noise floor)."""
    from .default_perplexity import default_method

    table = {
        "fp": lambda: with_label(get_method("fp"), "BF16 DynamicCache (reference)"),
        "bf16-kv": lambda: with_label(get_method("bf16-kv"), "BF16 KV via fake-quant path (noise floor)"),
        "identity": lambda: with_label(get_method("identity"), "naive INT2 (identity, G=64)"),
        "hadamard": lambda: with_label(get_method("hadamard"), "Hadamard INT2 (G=64)"),
        "kivi": lambda: with_label(get_method("kivi", bits=2, group_size=64, residual=128), "KIVI-2 (G=64, R=128)"),
        "turbo3": lambda: with_label(get_method("turbo", bits=3), "TurboQuant-style 3-bit (no windows)"),
        "turbo2": lambda: with_label(get_method("turbo", bits=2), "TurboQuant-style 2-bit (no windows)"),
        "hqq": lambda: with_label(get_method("hf-hqq", nbits=2, group_size=64, residual=128),
                                  "QuantizedCache hqq int2 (G=64, R=128)"),
        "quanto": lambda: with_label(get_method("hf-quanto", nbits=2, group_size=64, residual=128),
                                     "QuantizedCache quanto int2 (G=64, R=128)"),
    }
    rows = []
    for n in names:
        if n == "default":
            if artifact is None:
                raise ValueError("the 'default' row needs --artifact (scripts/calibrate.py --model smollm2 --out DIR)")
            from oscar_hf import OscarCache, OscarRotations

            row = default_method(OscarRotations.from_pretrained(artifact), "defaults (artifact, auto heads)")
            if row.make_cache(model).oscar_config != OscarCache.from_pretrained(artifact, model).oscar_config:
                raise RuntimeError("the defaults row does not build the cache OscarCache.from_pretrained builds")
            rows.append(row)
        elif n in table:
            rows.append(table[n]())
        else:
            raise ValueError(f"unknown method {n!r}; known: {sorted(['default', *table])}")
    return rows


def target(res: dict, defaults: str, baselines: Sequence[str]) -> dict:
    """Whether the ``defaults`` row's top-1 agreement beats every baseline's in every bucket, with the margins."""
    d = res["rows"][defaults]["buckets"]
    margins = {b: [dd["agreement"] - bb["agreement"] for dd, bb in zip(d, res["rows"][b]["buckets"])] for b in baselines}
    return dict(defaults=defaults, baselines=list(baselines), margins=margins,
                met=all(x > 0 for m in margins.values() for x in m))


def main(argv=None, model=None, tokenizer=None):
    """CLI. ``model`` / ``tokenizer``: run on these instead of loading ``--model``."""
    import argparse

    from oscar_hf.eval.models import GEMMA3, model_for_eval, wikitext_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help='"smollm2" (default) or "gemma3-270m"')
    p.add_argument("--artifact", default=None, help="calibrated artifact directory for the 'default' row")
    p.add_argument("--methods", default="default,hadamard,kivi,turbo3,turbo2,hqq,bf16-kv",
                   help="comma list: default, fp, bf16-kv, identity, hadamard, kivi, turbo3, turbo2, hqq, quanto")
    p.add_argument("--source", default=None, help="prompt text: .txt / .jsonl file or datasets name "
                                                  "(default: WikiText-2 raw test); its held-out part is used")
    p.add_argument("--text-field", default="text")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--tokens", type=int, default=4096, help="tokens generated per prompt (N)")
    p.add_argument("--chat", action="store_true", help="prompts: an instruction about each text window, through the "
                                                       "chat template (else the window itself)")
    p.add_argument("--sample", action="store_true", help="sampled continuations (Sampling's defaults), else greedy")
    p.add_argument("--seed", type=int, default=0, help="--sample: prompt i draws with seed + i")
    p.add_argument("--buckets", default=",".join(map(str, BUCKET_EDGES[1:])), help="bucket edges (positions)")
    p.add_argument("--path", choices=["fast", "exact"], default="fast",
                   help="fast: one fake-quantized forward per method where it has one; exact: real caches token by token")
    p.add_argument("--smooth", type=int, default=128, help="moving-average width of the PNG curves")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="long_generation")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [n for n in args.methods.split(",") if n]
    model, tokenizer, model_name, dtype = model_for_eval(model, tokenizer, getattr(torch, args.dtype), args.model)
    if args.chat and args.model == GEMMA3 and tokenizer.chat_template is None:
        tokenizer.chat_template = GEMMA3_CHAT_TEMPLATE
    rows = method_rows(names, args.artifact, model)
    source = args.source or str(wikitext_path())
    prompts = prompt_windows(tokenizer, source, args.prompt_len, args.prompts, text_field=args.text_field)
    prompts = chat_prompts(tokenizer, prompts) if args.chat else list(prompts)
    edges = [int(e) for e in args.buckets.split(",") if e]
    sampling = Sampling(seed=args.seed) if args.sample else None
    t0 = time.perf_counter()
    res = long_generation(model, prompts, rows, args.tokens, exact=args.path == "exact", edges=edges,
                          sampling=sampling, banned=stop_ids(model, tokenizer if args.chat else None))
    head_dim = ModelFingerprint.from_config(model.config).head_dim
    kv = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}.get(dtype, str(dtype))
    L = max(res["prompt_lens"])
    for m in rows:
        res["rows"][m.name]["bits"] = m.bits(L + args.tokens, head_dim, L)
    res["model"] = model_name
    out = dict(
        command="python -P scripts/eval_long_generation.py " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        setup=dict(model=model_name, dtype=str(dtype).removeprefix("torch."), reference=f"{kv} DynamicCache",
                   artifact=args.artifact, source=source, prompts=args.prompts, prompt_len=args.prompt_len,
                   chat=args.chat, prompt_lens=res["prompt_lens"], sampling=res["sampling"],
                   tokens=args.tokens, path=args.path, threads=torch.get_num_threads(),
                   seconds=round(time.perf_counter() - t0, 1)),
        reference_agreement=res["reference_agreement"], distinct_4grams=res["distinct_4grams"],
        rows={n: {k: v for k, v in r.items() if k not in ("kl", "agreement")} for n, r in res["rows"].items()})
    baselines = [m.name for n, m in zip(names, rows) if n not in ("default", *UNQUANTIZED)]
    if "default" in names and baselines:
        out["target"] = target(res, rows[names.index("default")].name, baselines)
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / f"{args.name}.json").write_text(json.dumps(out, indent=1))
    how = "greedy" if sampling is None else f"sampled ({res['sampling']})"
    md = (f"Command: `{out['command']}`\n\nReference: {model_name}, {kv} DynamicCache along its own {how} continuation; "
          f"{args.prompts} prompts of {min(res['prompt_lens'])}-{L} tokens"
          f"{' (an instruction through the chat template)' if args.chat else ''} + {args.tokens} generated; distinct "
          f"4-grams per continuation {', '.join(f'{d:.2f}' for d in res['distinct_4grams'])}; KL in nats.\n\n"
          + markdown(res))
    if "target" in out:
        md += (f"\nTarget (defaults' top-1 agreement above every other ≤3-bit row in every bucket): "
               f"{'met' if out['target']['met'] else 'missed'}\n")
    (dest / f"{args.name}.md").write_text(md)
    plot(res, dest / f"{args.name}.png", args.smooth)
    print(md)
    return res


if __name__ == "__main__":
    main()
