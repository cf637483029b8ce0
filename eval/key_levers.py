"""Which part of the cache loses the 8K needles, and which levers bring them back.

Every lever is a fake-quant view of the cache (:mod:`oscar_hf.eval.fakequant`): the defaults' artifact and coded
retrieval heads (INT8 by default, ``--retrieval-bits``), with the keys or values of the INT2 heads read another
way. Each locker needle (the unseen format of :mod:`oscar_hf.eval.needle`, pydoc haystack) is prefilled once, exactly,
and every lever then scores the answer teacher-forced in one forward (:func:`oscar_hf.eval.needle.fast_answer_scores`):
a needle counts when every answer token is the argmax (what greedy decoding of the right answer needs), and the
answer's NLL is kept. On the 24 interior needles at 8K the count of the cache with INT4 heads equals its greedy
exact-match count through the real cache (17).

    python -P -m oscar_hf.eval.key_levers --artifact DIR --threads 2 --retrieval-bits 4
    python -P -m oscar_hf.eval.key_levers --artifact DIR --threads 2 --perplexity   # what each lever costs in ppl

Levers (history bits: the average over the quantized layers' KV heads, keys and values, the coded retrieval heads
included; INTb below: the heads' width, ``OscarConfig.retrieval_bits``):

* ``keys exact`` / ``values exact``: the diagnosis, which half of the INT2 rows costs the needles (``every head``:
  the retrieval heads' keys exact too; ``retrieval heads' keys exact``: those alone);
* ``quantizer std``, ``Lloyd-Max levels``: other 4-level grids for the same bits (:mod:`oscar_hf.quant`);
* ``3-bit keys``: keys in 8 levels per group (3.5 bits with scale and zero), values INT2;
* ``INT4 keys, layers [...]``: the 4 layers of largest held-out key error (the artifact's ``heldout_error``) get
  16-level keys in the rotated space, a per-layer mixed budget;
* ``whole INTb layers``: the cache's retrieval-head budget spent, after its retrieval heads, on whole layers
  by that error up to 3.0 bits (min-max per token and head, unrotated: :mod:`oscar_hf.cache.heads`);
* ``INT8 retrieval heads`` (``INT4`` when the defaults' are INT8): the retrieval heads in the other width (the
  3.0-bit budget keeps fewer at INT8, more at INT4), alone and with per-channel keys;
* ``per-channel keys``: KIVI's key grouping in the rotated space: one scale and zero per channel and block of 64
  tokens instead of per token and group of 64 channels (the same bits);
* ``block-mean keys``: per-token groups as today after removing each channel's mean over its block of 64 tokens
  (the means in BF16: +0.25 bits per key element);
* ``keys exact, layers 0-14`` / ``15-29``: where in depth the key error matters; ``3-bit keys, layers 15-29``: the
  3-bit keys in the deeper half only.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from .fakequant import FakeQuantSpec
from .methods import OscarSpec
from .haystack import load_haystack
from .needle import LOCKER, MAGIC_NUMBER, fast_answer_scores, make_cells, make_needle_prompt

BLOCK = 64  # tokens per per-channel group / per block mean (KIVI's group of 64 tokens)


def rotated_fake_quant(x, r, mu, clip, bits: int, group: int = 64, axis: str = "token", block_mean: bool = False):
    """``x [B, H, T, D]`` -> its reconstruction after centering (``mu [H, D]``), rotating (``r [H, D, D]``) and
    ``bits``-bit asymmetric min-max codes with a clipped range; scale and zero rounded to BF16 as the cache stores
    them. ``axis="token"``: one scale and zero per token and group of ``group`` channels (the cache's rows);
    ``"channel"``: per channel and block of :data:`BLOCK` tokens (KIVI's keys). ``block_mean``: each channel's mean
    over its block of tokens (BF16) is removed before the per-token grouping and added back."""
    rows = (x.float() - mu[None, :, None, :]) @ r.float().unsqueeze(0)  # [B, H, T, D]
    b, h, t, d = rows.shape
    pad = -t % BLOCK
    blocks = torch.nn.functional.pad(rows, (0, 0, 0, pad)).reshape(b, h, (t + pad) // BLOCK, BLOCK, d)
    real = (torch.arange(t + pad, device=x.device) < t).reshape(1, 1, -1, BLOCK, 1)
    offset = 0.0
    if block_mean:
        offset = ((blocks * real).sum(3, keepdim=True) / real.sum(3, keepdim=True)).to(torch.bfloat16).float()
    if axis == "channel":
        groups = blocks  # [B, H, nb, BLOCK, D]: min / max over the block's tokens
        lo = torch.where(real, groups, torch.inf).amin(3, keepdim=True)
        hi = torch.where(real, groups, -torch.inf).amax(3, keepdim=True)
    else:
        groups = (blocks - offset).reshape(b, h, -1, BLOCK, d // group, group)  # min / max over a group's channels
        lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    levels = 2**bits - 1
    mid, half = (hi + lo) / 2, (hi - lo) / 2 * clip
    zero, scale = (mid - half).to(torch.bfloat16).float(), (2 * half / levels).to(torch.bfloat16).float()
    q = torch.round((groups - zero) / scale.clamp_min(1e-30)).clamp(0, levels)
    rec = (q * scale + zero).reshape(b, h, -1, BLOCK, d) + (0.0 if axis == "channel" else offset)
    rec = rec.reshape(b, h, -1, d)[:, :, :t]
    return rec @ r.float().transpose(-1, -2).unsqueeze(0) + mu[None, :, None, :]


class KeysOrValuesFrom(FakeQuantSpec):
    """``base`` (an :class:`OscarSpec`), with the keys (``part="k"``) or values of the INT2 heads of ``layers``
    replaced by ``read(x, layer_rotation) -> x_hat`` (``x``: those heads' rows; the retrieval heads and the
    window rules stay the base's)."""

    def __init__(self, base: OscarSpec, read, part: str = "k", layers=None):
        self.base, self.read, self.part, self.layers = base, read, part, layers
        self.retrieval_heads = base.retrieval_heads  # {layer: retrieval heads}, left as the base reads them

    def layer_kv(self, i, k, v):
        out = self.base.layer_kv(i, k, v)
        if out is None or (self.layers is not None and i not in self.layers):
            return out
        q = [h for h in range(k.shape[1]) if h not in self.retrieval_heads.get(i, ())]
        if not q:
            return out
        kh, vh = (t.float().clone() for t in out)
        lr = self.base.rot.layers[i].select_heads(q)
        if self.part == "k":
            kh[:, q] = self.read(k[:, q], lr).float()
        else:
            vh[:, q] = self.read(v[:, q], lr).float()
        return kh, vh

    def exact_mask(self, n, prefill_len, device):
        return self.base.exact_mask(n, prefill_len, device)


class HeadKeysExact(FakeQuantSpec):
    """``inner`` (a :class:`KeysOrValuesFrom` or :class:`OscarSpec`), with the retrieval heads' keys
    read exactly instead of from their codes."""

    def __init__(self, inner):
        self.inner, self.retrieval_heads = inner, inner.retrieval_heads

    def layer_kv(self, i, k, v):
        out = self.inner.layer_kv(i, k, v)
        if out is None or i not in self.retrieval_heads:
            return out
        kh, vh = (t.float().clone() for t in out)
        heads = list(self.retrieval_heads[i])
        kh[:, heads] = k[:, heads].float()
        return kh, vh

    def exact_mask(self, n, prefill_len, device):
        return self.inner.exact_mask(n, prefill_len, device)


def history_bits(n_heads: int, fp_heads: int, key_bits: float, value_bits: float, fp_bits: float) -> float:
    """Average bits per history element: ``fp_heads`` of ``n_heads`` at ``fp_bits``, the rest at the mean of their
    key and value bits."""
    return (fp_heads * fp_bits + (n_heads - fp_heads) * (key_bits + value_bits) / 2) / n_heads


def levers(model, rotations, config) -> dict[str, tuple[FakeQuantSpec | None, float | None]]:
    """``{label: (spec, history bits)}`` (bits None: a diagnosis, not a storage)."""
    from oscar_hf.layer_choice import resolve_retrieval_heads
    from oscar_hf.config import ModelFingerprint

    fp = ModelFingerprint.from_config(model.config)
    base = OscarSpec(model, rotations, config)
    n = len(rotations.layers) * fp.num_key_value_heads
    p = sum(map(len, base.retrieval_heads.values()))
    row = config.history_bits(fp.head_dim)  # an INT2 row's bits per element (2.5 at group 64, BF16 scale and zero)
    head = config.retrieval_head_bits(fp.head_dim)  # a retrieval head's (8.5 at INT8, D = 64)
    bits = lambda key_bits: history_bits(n, p, key_bits, row, head)  # noqa: E731
    errors = {int(i): float(e["k_rel"]) for i, e in rotations.metadata.get("heldout_error", {}).items()}
    worst = sorted(errors, key=lambda i: -errors[i])

    def keys(bits=2, axis="token", clip=None, block_mean=False, group=config.group_size):
        return lambda x, lr: rotated_fake_quant(x, lr.r_k, lr.mu_k, lr.clip_k if clip is None else clip, bits,
                                                group, axis, block_mean)

    exact = lambda x, lr: x  # noqa: E731
    out = {
        "BF16 DynamicCache": (None, 16.0),
        f"defaults ({p} INT{config.retrieval_bits} retrieval heads)": (base, bits(row)),
        "keys exact": (KeysOrValuesFrom(base, exact, "k"), None),
        "keys exact, every head": (HeadKeysExact(KeysOrValuesFrom(base, exact, "k")), None),
        "retrieval heads' keys exact": (HeadKeysExact(base), None),
        "values exact": (KeysOrValuesFrom(base, exact, "v"), None),
        "quantizer std": (OscarSpec(model, rotations, config.replace(quantizer="std")), bits(row)),
        "Lloyd-Max levels": (OscarSpec(model, rotations, config, levels="lloyd-max"), bits(row)),
        "3-bit keys": (KeysOrValuesFrom(base, keys(3, clip=1.0)), bits(row + 1)),
    }
    # keys in 8 levels and values in 4, both at twice the group: at group 32 the same bits as INT2 rows at 32
    g2 = 2 * config.group_size
    if fp.head_dim % g2 == 0:
        wide = config.replace(group_size=g2)
        base_wide, row2 = OscarSpec(model, rotations, wide), wide.history_bits(fp.head_dim)
        out[f"3-bit keys, keys and values at group {g2}"] = (
            KeysOrValuesFrom(base_wide, keys(3, clip=1.0, group=g2)), history_bits(n, p, row2 + 1, row2, head))
    # 3-bit keys at the group, values at coarser ones (2, 4 and 8 times it): the values' metadata pays the keys' bit
    for gv in (2 * config.group_size, 4 * config.group_size, 8 * config.group_size):
        if fp.head_dim % gv == 0:
            wide = config.replace(group_size=gv)
            out[f"3-bit keys, values at group {gv}"] = (
                KeysOrValuesFrom(OscarSpec(model, rotations, wide), keys(3, clip=1.0)),
                history_bits(n, p, row + 1, wide.history_bits(fp.head_dim), head))
    if worst:
        top = set(worst[:4])
        n_int4 = sum(1 for i in top for h in range(fp.num_key_value_heads) if h not in base.retrieval_heads.get(i, ()))
        out[f"INT4 keys, layers {sorted(top)}"] = (
            KeysOrValuesFrom(base, keys(4, clip=1.0), layers=top), bits(row) + n_int4 * 1.0 / n)
        pairs = {(i, h) for i, hs in base.retrieval_heads.items() for h in hs}  # the retrieval heads, then whole layers
        budget = config.retrieval_head_budget(fp.head_dim, n)
        for i in worst:
            rest = {(i, h) for h in range(fp.num_key_value_heads)} - pairs
            if len(pairs) + len(rest) <= budget:
                pairs |= rest
        whole = config.replace(retrieval_heads=tuple(sorted(pairs)))
        layers = sorted(i for i in worst if all((i, h) in pairs for h in range(fp.num_key_value_heads)))
        out[f"whole INT{config.retrieval_bits} layers {layers}"] = (
            OscarSpec(model, rotations, whole), history_bits(n, len(pairs), row, row, head))
    out["per-channel keys"] = (KeysOrValuesFrom(base, keys(axis="channel", clip=1.0)), bits(row))
    # the retrieval heads in the other width (INT8 beside INT4 defaults, INT4 beside INT8), as many as the budget keeps
    other = 4 if config.retrieval_bits == 8 else 8
    auto = config.replace(retrieval_bits=other, retrieval_heads="auto")
    heads = resolve_retrieval_heads(auto, rotations, fp, set())
    alt = auto.replace(retrieval_heads=tuple(sorted((i, h) for i, hs in heads.items() for h in hs)))
    base_alt = OscarSpec(model, rotations, alt)
    p_alt = sum(map(len, base_alt.retrieval_heads.values()))
    bits_alt = history_bits(n, p_alt, row, row, alt.retrieval_head_bits(fp.head_dim))
    out[f"{p_alt} INT{other} retrieval heads"] = (base_alt, bits_alt)
    out[f"per-channel keys, {p_alt} INT{other} retrieval heads"] = (
        KeysOrValuesFrom(base_alt, keys(axis="channel", clip=1.0)), bits_alt)
    # + a BF16 mean per channel and block of BLOCK tokens: 16 / BLOCK bits per key element
    out["block-mean keys"] = (KeysOrValuesFrom(base, keys(block_mean=True)), bits(row + 16 / BLOCK))
    quantized = sorted(int(i) for i in rotations.layers)  # (Gemma's full-attention layers: 5, 11, 17)
    half = len(quantized) // 2
    for part in (quantized[:half], quantized[half:]):
        if part:
            out[f"keys exact, layers {part[0]}-{part[-1]}"] = (KeysOrValuesFrom(base, exact, layers=set(part)), None)
    if half:  # 3-bit keys in the deeper half only: +1 bit on its INT2 keys (+0.5 over keys and values)
        deep = set(quantized[half:])
        n3 = sum(1 for i in deep for h in range(fp.num_key_value_heads) if h not in base.retrieval_heads.get(i, ()))
        out[f"3-bit keys, layers {quantized[half]}-{quantized[-1]}"] = (
            KeysOrValuesFrom(base, keys(3, clip=1.0), layers=deep), bits(row) + n3 * 0.5 / n)
    return out


def report(res: dict) -> str:
    rows = res["levers"]
    ref = rows["BF16 DynamicCache"]["correct"]
    lines = [f"{res['needles']} {res.get('format', 'locker')} needles at {res['length']} tokens, depths "
             f"{res['depths']}, teacher-forced "
             "(a needle counts when every answer token is the argmax)", "",
             "| cache | history bits | needles | vs BF16 | mean answer NLL (nats) |", "|---|---|---|---|---|"]
    for label, r in rows.items():
        bits = "diagnosis" if r["bits"] is None else f"{r['bits']:.2f}"
        lines.append(f"| {label} | {bits} | {r['correct']}/{res['needles']} | {r['correct'] / max(ref, 1):.2f} | "
                     f"{r['nll']:.3f} |")
    return "\n".join(lines) + "\n"


def perplexities(model, tokenizer, specs: dict, windows: int, context: int) -> dict:
    """``{label: {text: {"ppl", "nll", "tokens"}}}``: every lever's fake-quant perplexity, token by token in effect
    (one forward per window, :func:`oscar_hf.eval.perplexity.fast_nll`), on ``windows`` held-out windows of
    ``context`` tokens of WikiText and of the pydoc prose, each window's first token the prompt (BOS where the
    tokenizer adds one)."""
    from tqdm.auto import tqdm

    from .default_perplexity import TEXTS, window_ids
    from .perplexity import fast_nll

    out = {label: {} for label in specs}
    bar = tqdm(total=len(TEXTS) * len(specs), desc="perplexity")
    for text in TEXTS:  # (a tokenizer that adds BOS, Gemma's, starts every window with it)
        ids = window_ids(tokenizer, text, context, windows).reshape(windows, context)
        for label, (spec, _) in specs.items():
            with torch.no_grad():
                r = fast_nll(model, ids, 1, spec)
            out[label][text] = dict(ppl=r["ppl"], nll=r["nll"], tokens=r["tokens"])
            bar.update(1)
    bar.close()
    return out


def ppl_report(res: dict) -> str:
    rows, ref = res["levers"], res["levers"]["BF16 DynamicCache"]
    lines = [f"Fake-quant perplexity, {res['windows']} window(s) of {res['context']} tokens per text, every token after "
             "the first read through the cache's decode-time view", "",
             "| cache | history bits | " + " | ".join(f"{t} ppl | vs BF16" for t in res["texts"]) + " |",
             "|---|---|" + "---|---|" * len(res["texts"])]
    for label, r in rows.items():
        bits = "diagnosis" if r["bits"] is None else f"{r['bits']:.2f}"
        cells = [f"{r[t]['ppl']:.3f} | {100 * (r[t]['ppl'] / ref[t]['ppl'] - 1):+.2f}%" for t in res["texts"]]
        lines.append(f"| {label} | {bits} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_results(out: Path, name: str, res: dict, text: str) -> None:
    """``<name>.json`` (everything) and ``<name>.md`` (the command, then ``text``) under ``out``; ``text`` printed."""
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    (out / f"{name}.md").write_text(f"Command: `{res['command']}`\n\n" + text)
    print(text)


def main(argv=None):
    import argparse
    import sys

    from tqdm.auto import tqdm

    from oscar_hf import OscarCache
    from oscar_hf.config import RETRIEVAL_BIT_CHOICES
    from oscar_hf.eval.models import model_for_eval

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help='"smollm2" or "gemma3-270m"')
    p.add_argument("--artifact", required=True, help="the calibrated artifact (scripts/calibrate.py --out DIR)")
    p.add_argument("--format", default="locker", choices=["locker", "magic-number"], help="the needle's wording")
    p.add_argument("--length", type=int, default=8176)
    p.add_argument("--depths", default="0.3,0.5,0.7,0.9", help="of the grid 0.1,...,0.9 (BF16 misses every 10%%)")
    p.add_argument("--trials", type=int, default=6)
    p.add_argument("--hay-stride", type=int, default=997)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--only", default=None,
                   help="comma list: run only the levers whose label contains one of these (BF16 and the defaults "
                        "always run)")
    p.add_argument("--retrieval-bits", "--full-precision-bits", dest="retrieval_bits", type=int,
                   choices=RETRIEVAL_BIT_CHOICES, default=None,
                   help="how the retrieval heads are stored (default: OscarConfig's, 8; the committed 8K needle and "
                        "perplexity tables were run at 4)")
    p.add_argument("--perplexity", action="store_true",
                   help="instead of the needles: each lever's perplexity on WikiText and pydoc (--windows x --context)")
    p.add_argument("--windows", type=int, default=1)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--name", default=None, help="output stem (default needle_key_levers_8k_smollm2_cpu, or "
                                                "ppl_key_levers_smollm2_cpu with --perplexity)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the model's dtype (float32: several times faster on a CPU without bfloat16 instructions)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok, _, _ = model_for_eval(None, None, getattr(torch, args.dtype), args.model)
    over = {} if args.retrieval_bits is None else dict(retrieval_bits=args.retrieval_bits)
    cache = OscarCache.from_pretrained(args.artifact, model, **over)  # the defaults, heads resolved
    specs = levers(model, cache.rotations, cache.oscar_config)
    if args.only:
        keep = [w.strip() for w in args.only.split(",")]
        specs = {k: v for j, (k, v) in enumerate(specs.items()) if j < 2 or any(w in k for w in keep)}
    out = Path(args.out)
    command = "python -P -m oscar_hf.eval.key_levers " + " ".join(argv if argv is not None else sys.argv[1:])
    if args.perplexity:
        from .default_perplexity import TEXTS

        name = args.name or "ppl_key_levers_smollm2_cpu"
        ppl = perplexities(model, tok, specs, args.windows, args.context)
        res = dict(command=command, dtype=args.dtype, windows=args.windows, context=args.context, texts=list(TEXTS),
                   artifact=str(args.artifact), levers={k: dict(bits=b, **ppl[k]) for k, (_, b) in specs.items()})
        write_results(out, name, res, ppl_report(res))
        return
    grid = (0.1, 0.3, 0.5, 0.7, 0.9)  # the needle grid's draws, so that these are the needle CLI's needles
    run = [float(d) for d in args.depths.split(",")]
    fmt = LOCKER if args.format == "locker" else MAGIC_NUMBER
    cells = make_cells([args.length], grid, args.trials, 0, fmt)
    hay = load_haystack(tok, "pydoc", args.length + (args.trials - 1) * args.hay_stride)
    trial, raw = {}, []
    for L, d, key, value in tqdm(cells, desc="needles"):
        t = trial[d] = trial.get(d, -1) + 1
        if d not in run:
            continue
        ctx, q, _ = make_needle_prompt(tok, hay, L, d, key, value, fmt, t * args.hay_stride)
        t0 = time.perf_counter()
        with torch.no_grad():
            scores = fast_answer_scores(model, tok, ctx, q, value, {k: s for k, (s, _) in specs.items()})
        raw.append(dict(depth=d, trial=t, value=value, seconds=round(time.perf_counter() - t0, 1), scores=scores))
    res = dict(command=command, dtype=args.dtype, length=args.length, format=args.format, depths=run, needles=len(raw),
               artifact=str(args.artifact), levers={
                   k: dict(bits=b, correct=sum(r["scores"][k]["argmax_correct"] for r in raw),
                           nll=sum(r["scores"][k]["nll"] for r in raw) / max(len(raw), 1))
                   for k, (_, b) in specs.items()}, raw=raw)
    name = args.name or "needle_key_levers_8k_smollm2_cpu"
    write_results(out, name, res, report(res))


if __name__ == "__main__":
    main()
