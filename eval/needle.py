"""RULER-style single needle in a haystack, read through a KV cache.

A key/value pair ("The special magic number for <key> is: <7 digits>.") is inserted at a relative
depth of a haystack (held-out WikiText, or a repeated filler), followed by a question. Because
OscarCache's prefill is exact on the prompt, the haystack is the prefill and the question is fed
token by token as decode steps: every question token and every answer token reads the needle from
the cache under test (INT2 history once it left the recent window). The answer is greedy.

    python -m oscar_hf.eval.needle --lengths 1024,2048,4096 --depths 0,0.5,1
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch

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
    out = model(context[None].to(dev), past_key_values=cache, use_cache=True)
    for t in question:  # decode steps: the question reads the needle through the cache
        out = model(t.view(1, 1).to(dev), past_key_values=cache, use_cache=True)
    new = []
    for _ in range(max_new_tokens):
        nxt = out.logits[0, -1].argmax()
        if nxt.item() == tokenizer.eos_token_id:
            break
        new.append(nxt.item())
        out = model(nxt.view(1, 1), past_key_values=cache, use_cache=True)
    return tokenizer.decode(new, skip_special_tokens=True)


def run_grid(model, tokenizer, haystack_ids, methods: dict, lengths, depths, trials: int = 1, seed: int = 0,
             progress: bool = True) -> dict:
    """``{method: {length: {depth: accuracy}}}`` plus the raw answers."""
    from tqdm.auto import tqdm

    rng = random.Random(seed)
    cells = [(L, d, rng.choice(KEYS), str(rng.randint(1_000_000, 9_999_999))) for L in lengths for d in depths
             for _ in range(trials)]
    res, raw = {}, []
    bar = tqdm(total=len(cells) * len(methods), desc="needle", disable=not progress)
    for name, method in methods.items():
        acc = {}
        for L, d, key, value in cells:
            ctx, q, at = make_needle_prompt(tokenizer, haystack_ids, L, d, key, value)
            a = answer(model, tokenizer, ctx, q, lambda: method.make_cache(model))
            ok = score_answer(a, value)
            acc.setdefault(str(L), {}).setdefault(str(d), []).append(ok)
            raw.append(dict(method=name, length=L, depth=d, value=value, answer=a, correct=ok))
            bar.update()
        res[name] = {L: {d: sum(v) / len(v) for d, v in dd.items()} for L, dd in acc.items()}
    bar.close()
    return {"accuracy": res, "answers": raw}


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

    from oscar_hf.models import load_model

    from .compare import find_artifact
    from .methods import OscarFamily, get_method
    from .perplexity import evaluation_ids

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0,0.5,1")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--haystack", choices=["wikitext", "filler"], default="wikitext")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    model, tok = load_model("smollm2", dtype=torch.float32)
    hay = evaluation_ids(tok, max(lengths)) if args.haystack == "wikitext" else filler_ids(tok, max(lengths))
    W = dict(sink=64, recent=256, group_size=64)
    methods = {"FP32 KV": get_method("fp"), "naive INT2": get_method("identity", **W), "Hadamard": get_method("hadamard", **W)}
    osc = find_artifact("oscar", 64)
    if osc is not None:
        methods["OSCAR + centering"] = OscarFamily("oscar", rotations=osc, **W)
    res = run_grid(model, tok, hay, methods, lengths, depths, args.trials)
    res["command"] = "python -m oscar_hf.eval.needle " + " ".join(argv or __import__("sys").argv[1:])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"needle_{args.haystack}.json").write_text(json.dumps(res, indent=1))
    plot_heatmaps(res["accuracy"], out / f"needle_{args.haystack}.png")
    print(json.dumps(res["accuracy"], indent=1))


if __name__ == "__main__":
    main()
