"""The needle evaluation's command line and reports (``scripts/eval_needle.py``): the rows to compare, the grid run
(:func:`oscar_hf.eval.needle.run_grid`, resumable from its JSON), and the Markdown table, heat maps and target lines.

    python -P scripts/eval_needle.py --lengths 1024,2048,4096 --depths 0,0.5,1 --methods fp,oscar
    python -P scripts/eval_needle.py --model gemma3-270m --artifact oscar_hf/pretrained/gemma-3-270m --methods fp,artifact \\
        --lengths 1024,2048,4096 --depths 0.25,0.5,0.75 --dtype bfloat16 --name needle_gemma3_cpu
"""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import torch

from .haystack import load_haystack
from .needle import (FORMATS, MAGIC_NUMBER, GridOptions, accuracy_table, history_bits, length_summary,
                     nll_table, run_grid)


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
        ax.set(xlabel="context length", ylabel="needle depth")
        ax.set_title("\n".join(textwrap.wrap(name, 32)), fontsize=9)  # long cache labels on two lines
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def target_summary(acc: dict, reference: str, threshold: float = 0.9) -> str:
    """One line per non-reference method: its accuracy ratio to ``reference`` per length (mean over the run's
    depths) and whether every length reaches ``threshold``."""
    summ = length_summary(acc, reference)
    lines = []
    for m in acc:
        if m == reference:
            continue
        ratios = {L: summ[m][L].get("ratio_to_reference") for L in sorted(summ[m], key=int)}
        met = all(r is not None and r >= threshold for r in ratios.values())
        lines.append(f"* {m} / {reference}: " + ", ".join(f"{L}: " + (f"{r:.2f}" if r is not None else "—")
                                                           for L, r in ratios.items())
                     + f" -> {'meets' if met else 'misses'} >= {threshold:g}x at every length")
    return "\n".join(lines) + "\n"


def bits_summary(setup: dict) -> str:
    """The storage of the retrieval heads and, per OscarCache row, its history bits (:func:`history_bits`; files
    written before the rename name them ``full_precision_*``)."""
    rows = [(label, u) for label, u in setup.get("user_caches", {}).items() if "history_bits" in u]
    if not rows:
        return ""
    old = lambda u, key, default=None: u.get(f"retrieval_{key}", u.get(f"full_precision_{key}", default))  # noqa: E731
    lines = [f"\nRetrieval heads: {old(setup, 'storage', 'BF16')}."]
    lines += [f"* {label}: {old(u, 'heads')} of {u['kv_heads']} KV heads at "
              f"{old(u, 'head_bits'):g} bits -> {u['history_bits']:.3f} history bits per element"
              for label, u in rows]
    return "\n".join(lines) + "\n"


class UserCache:
    """A row whose cache is built exactly as a user builds it, ``make(model)`` (e.g. ``OscarCache(model)``):
    the library's own defaults, no harness-side settings."""

    fast = False

    def __init__(self, name: str, make):
        self.name, self.make = name, make

    def make_cache(self, model):
        return self.make(model)


def main(argv=None, model=None, tokenizer=None):
    """CLI (``scripts/eval_needle.py``). ``model`` / ``tokenizer``: run on these instead of loading ``--model``."""
    import argparse
    import platform
    import sys

    from oscar_hf import OscarCache, OscarConfig, OscarRotations
    from oscar_hf.config import RETRIEVAL_BIT_CHOICES
    from oscar_hf.eval.models import model_for_eval
    from oscar_hf.quant import QUANTIZERS

    from .compare import find_artifact
    from .methods import OscarFamily, get_method, with_label

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help='"smollm2" (default) or "gemma3-270m"')
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--depths", default="0,0.5,1")
    p.add_argument("--run-depths", default=None,
                   help="comma list: run only these of --depths, on the same needles (e.g. the interior ones)")
    p.add_argument("--run-lengths", default=None,
                   help="comma list: run only these of --lengths, on the same needles (the needles are drawn "
                        "trial-major over every length: a shorter --lengths draws others)")
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--score", choices=["generate", "nll"], default="generate",
                   help="generate: greedy answer, exact match; nll: teacher-forced NLL of the right answer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--format", choices=sorted(FORMATS), default="magic-number",
                   help="needle format: magic-number (RULER) or locker (unseen by calibration's probes)")
    p.add_argument("--haystack", choices=["wikitext", "filler", "pydoc"], default="wikitext",
                   help="haystack text: held-out WikiText, a repeated filler, or the stdlib's Python reference prose")
    p.add_argument("--hay-stride", type=int, default=0,
                   help="trial t reads the haystack from token t * stride on (0: every trial the same text)")
    p.add_argument("--share-prefill", action="store_true",
                   help="one exact prefill per needle, written into every method's cache (write_prefix)")
    p.add_argument("--methods", default="fp,identity,hadamard,oscar",
                   help="comma list of fp, identity, hadamard, oscar (OSCAR + centering, needs the artifact), "
                        "default (OscarCache(model)), artifact (OscarCache.from_pretrained(--artifact, model)), "
                        "artifact-noheads (the same with retrieval_heads=0)")
    p.add_argument("--artifact", default=None, help="OSCAR artifact dir (default: artifacts/smollm2-oscar)")
    p.add_argument("--group-size", type=int, default=64, help="group size of the quantized rows (default 64)")
    p.add_argument("--clip-k", type=float, default=None, help="OSCAR row: key clip ratio (default: the artifact's)")
    p.add_argument("--clip-v", type=float, default=None, help="OSCAR row: value clip ratio (default: the artifact's)")
    p.add_argument("--key-offset", choices=["calibrated", "prefill"], default="calibrated",
                   help="OSCAR row: key offset of the history (OscarConfig.key_offset)")
    p.add_argument("--retrieval-heads", "--full-precision-heads", dest="retrieval_heads", type=int, default=0,
                   help="OSCAR row: keep the artifact's k best retrieval heads out of INT2 "
                        "(OscarConfig.retrieval_heads; needs scripts/find_retrieval_heads.py scores)")
    p.add_argument("--label", default=None, help="label of the OSCAR row (default 'OSCAR + centering')")
    p.add_argument("--retrieval-bits", "--full-precision-bits", dest="retrieval_bits", type=int,
                   choices=RETRIEVAL_BIT_CHOICES, default=None,
                   help="OscarConfig.retrieval_bits of the OSCAR and artifact rows: how their retrieval "
                        "heads are stored (16: model dtype; 8/4: codes with a scale and zero per token and head; "
                        "default: the library's)")
    p.add_argument("--quantizer", choices=QUANTIZERS, default=None,
                   help="OscarConfig.quantizer of the OSCAR and artifact rows (default: the library's)")
    p.add_argument("--artifact-retrieval-heads", "--artifact-full-precision-heads", dest="artifact_retrieval_heads",
                   default="auto", help="artifact row: 'auto' (the library's rule at --retrieval-bits) or k (the artifact's "
                        "k best retrieval heads)")
    for name, what in (("sink", "sink tokens"), ("recent", "recent tokens"), ("group-size", "group size")):
        p.add_argument(f"--artifact-{name}", type=int, default=None,
                       help=f"artifact row: its {what} instead of the artifact's chosen ones")
    p.add_argument("--dtype", default="float32", help="model dtype (bfloat16: the cache keeps K/V in bf16)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default=None, help="output stem (default needle_<haystack>)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--report-only", action="store_true", help="re-plot <name>.png from <name>.json")
    args = p.parse_args(argv)
    out = Path(args.out)
    stem = args.name or f"needle_{args.haystack}"
    fmt = FORMATS[args.format]
    if args.report_only:
        res = json.loads((out / f"{stem}.json").read_text())
        plot_heatmaps(res["accuracy"], out / f"{stem}.png")
        report = (markdown_table(res) + "\n" + target_summary(res["accuracy"], next(iter(res["accuracy"])))
                  + bits_summary(res.get("setup", {})))
        (out / f"{stem}.md").write_text(f"Command: `{res['command']}`\n\n" + report)
        print(report)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    dtype = getattr(torch, args.dtype)
    model, tokenizer, model_name, dtype = model_for_eval(model, tokenizer, dtype, args.model)
    hay = load_haystack(tokenizer, args.haystack, max(lengths) + (args.trials - 1) * args.hay_stride)
    W = dict(sink=64, recent=256, group_size=args.group_size)
    # the OSCAR row's settings beyond the windows: clip overrides and the key offset
    oscar_kw = {k: v for k, v in (("clip_k", args.clip_k), ("clip_v", args.clip_v)) if v is not None}
    oscar_kw["key_offset"] = args.key_offset
    # the OSCAR row keeps exactly --retrieval-heads (0: none), whatever the library default ("auto")
    oscar_kw["retrieval_heads"] = args.retrieval_heads
    kv = {torch.bfloat16: "BF16", torch.float16: "FP16", torch.float32: "FP32"}.get(dtype, str(dtype))
    fp_bits = args.retrieval_bits or OscarConfig().retrieval_bits
    if args.retrieval_bits is not None:
        oscar_kw["retrieval_bits"] = fp_bits
    if args.quantizer is not None:
        oscar_kw["quantizer"] = args.quantizer
    artifact_heads = args.artifact_retrieval_heads
    if artifact_heads != "auto":
        if not artifact_heads.isdigit():
            raise ValueError(f"--artifact-retrieval-heads must be 'auto' or an int >= 0, got {artifact_heads!r}")
        artifact_heads = int(artifact_heads)

    def artifact_row():
        """The artifact row: the library's own cache (exactly what a user gets without the two options)."""
        kw = {} if args.retrieval_bits is None else dict(retrieval_bits=fp_bits)
        if artifact_heads != "auto":
            kw["retrieval_heads"] = artifact_heads
        if args.quantizer is not None:
            kw["quantizer"] = args.quantizer
        kw.update({k: v for k, v in (("sink", args.artifact_sink), ("recent", args.artifact_recent),
                                     ("group_size", args.artifact_group_size)) if v is not None})
        opts = "".join(f", {k}={v}" for k, v in kw.items())
        return (f"OscarCache.from_pretrained({Path(args.artifact).name}{opts})",
                UserCache("artifact", lambda m: OscarCache.from_pretrained(args.artifact, m, **kw)))

    builders = {
        "fp": lambda: (f"{kv} DynamicCache", get_method("fp")),
        "identity": lambda: ("naive INT2", get_method("identity", **W)),
        "hadamard": lambda: ("Hadamard", get_method("hadamard", **W)),
        "oscar": lambda: (args.label or "OSCAR + centering", OscarFamily("oscar", rotations=osc, **W, **oscar_kw)),
        "default": lambda: ("OscarCache(model)", UserCache("default", lambda m: OscarCache(m))),
        "artifact": artifact_row,
        "artifact-noheads": lambda: (
            f"OscarCache.from_pretrained({Path(args.artifact).name}, retrieval_heads=0)",
            UserCache("artifact-noheads",
                      lambda m: OscarCache.from_pretrained(args.artifact, m, retrieval_heads=0))),
    }
    wanted = args.methods.split(",")
    unknown = [m for m in wanted if m not in builders]
    if unknown:
        raise ValueError(f"unknown --methods {unknown}; known: {sorted(builders)}")
    osc = None
    if "oscar" in wanted:
        osc = OscarRotations.from_pretrained(args.artifact) if args.artifact else find_artifact("oscar", 64)
        if osc is not None and args.artifact:
            osc.metadata["path"] = args.artifact
    methods, user_caches = {}, {}
    for m in wanted:
        if (m == "oscar" and osc is None) or (m.startswith("artifact") and args.artifact is None):
            print(f"no OSCAR artifact given/found: skipping the {m!r} row", file=sys.stderr)
            continue
        label, method = builders[m]()
        methods[label] = with_label(method, label)
        if isinstance(method, UserCache):  # record what the user-built cache runs with
            c = method.make_cache(model)
            user_caches[label] = dict(repr=repr(c), config=c.oscar_config.to_dict(), **history_bits(c))
    out.mkdir(parents=True, exist_ok=True)
    store = out / f"{stem}.json"
    command = "python -P scripts/eval_needle.py " + " ".join(argv if argv is not None else sys.argv[1:])
    setup = dict(model=model_name, dtype=str(dtype).removeprefix("torch."), format=fmt.name,
                 needle=fmt.needle, question=fmt.question, haystack=args.haystack, hay_stride=args.hay_stride,
                 lengths=lengths, depths=depths, trials=args.trials, seed=args.seed, window=W, oscar=oscar_kw,
                 artifact=osc.metadata.get("path") if osc is not None else args.artifact, user_caches=user_caches,
                 share_prefill=args.share_prefill, retrieval_bits=fp_bits,
                 retrieval_storage=(
                     "the model dtype" if fp_bits == 16 else
                     f"INT{fp_bits} codes with an asymmetric min-max scale and zero per token and head in the model "
                     "dtype (OscarConfig.retrieval_bits)"),
                 # pydoc_data.topics is the running Python's: another version is another haystack
                 python=platform.python_version(),
                 protocol="haystack+needle prefilled through the cache (--share-prefill: one exact prefill written "
                          "into each method's cache); question fed token by token as decode steps; greedy answer, "
                          f"max {fmt.max_new_tokens} new tokens; correct iff "
                          + ("the first number equals the value" if fmt is MAGIC_NUMBER
                             else "the first code-shaped word equals the code"))
    done = []
    if store.is_file():
        old = json.loads(store.read_text()).get("setup", {})
        if (old.get("dtype") == setup["dtype"] and old.get("haystack") == args.haystack
                and old.get("format", "magic-number") == fmt.name and old.get("hay_stride", 0) == args.hay_stride
                and old.get("retrieval_bits", old.get("full_precision_bits", 16)) == fp_bits):
            done = json.loads(store.read_text()).get("answers", [])

    def save(raw):
        acc = accuracy_table(raw)
        ref = next(iter(methods))
        store.write_text(json.dumps(dict(command=command, setup=setup, accuracy=acc,
                                         by_length=length_summary(acc, ref), answer_nll=nll_table(raw),
                                         answers=raw), indent=1))

    run_depths = tuple(float(x) for x in args.run_depths.split(",")) if args.run_depths else None
    run_lengths = tuple(int(x) for x in args.run_lengths.split(",")) if args.run_lengths else None
    opts = GridOptions(trials=args.trials, seed=args.seed, run_depths=run_depths, run_lengths=run_lengths,
                       score=args.score, fmt=fmt,
                       hay_stride=args.hay_stride, share_prefill=args.share_prefill)
    res = run_grid(model, tokenizer, hay, methods, lengths, depths, opts, done=done, on_result=save)
    save(res["answers"])
    if args.score == "nll":
        print(nll_markdown(res["nll"]))
        (out / f"{stem}.md").write_text(f"Command: `{command}`\n\n" + nll_markdown(res["nll"]))
        return
    plot_heatmaps(res["accuracy"], out / f"{stem}.png")
    report = markdown_table(res) + "\n" + target_summary(res["accuracy"], next(iter(methods))) + bits_summary(setup)
    (out / f"{stem}.md").write_text(f"Command: `{command}`\n\n" + report)
    print(report)


if __name__ == "__main__":
    main()
