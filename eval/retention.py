"""Recall after the window flush: a verbatim-retention probe, and a check of a cache's windows.

Two failures the authors of OSCAR report were missed by every fluency metric: a model whose full-precision windows
were silently off, and one whose recent rows did not follow the window flush. Both show in one probe: a passage of
~35 words sits in the recent (full-precision) window at prefill; the model then generates ``--tokens`` (>= 700)
tokens, during which every row of the passage is demoted to the INT2 history; a cue then asks for the passage word
for word, and the cache under test must give back what BF16 gives back.

Protocol (:func:`probe`): the prompt is ``prefix`` tokens of held-out WikiText, a line that asks to remember a note
and the passage in quotes; BF16 (``DynamicCache``) continues it by sampling (seeded, so it does not loop) for
``--tokens`` tokens, a continuation checked not to repeat the passage; every cache then reads the prompt as one
prefill and the continuation and the cue (``The note, word for word: "`` + the passage's first words) one decode
step per token, exactly as ``generate`` writes them, and greedily decodes the rest of the passage. Scored: whether
the recall is word for word (up to the closing quote) and how many of the passage's words it gets right before the
first wrong one. The probe refuses a layout where the passage is not inside the recent window at prefill or not
wholly in the INT2 history when the cue starts, and a cache whose windows are smaller than the ones its artifact
chose (:func:`check_windows`).

    python -P -m oscar_hf.eval.retention --model smollm2 --artifact /tmp/smollm2 --tokens 720 \\
        --name retention_smollm2_cpu
"""
from __future__ import annotations

import json
import sys
import time
import warnings
from pathlib import Path

import torch

from oscar_hf.compat import cache_kwargs

# novel passages (written for this probe: a model cannot know them from training), ~35 words each
PASSAGES = (
    "The lighthouse keeper on Varn Island wrote that the copper bell rang nine times before dawn, that the eastern "
    "pier lost four planks in the storm, and that the ferry from Ostby returns on Thursday with flour.",
    "Marta left the blue ledger under the third stair, paid the glazier eleven silver coins for the round window, "
    "and told her brother that the orchard gate must stay shut until the plums turn dark.",
    "At the river station the engineer counted seven barges of slate, two of cedar and one of salt, then signed "
    "the tally in green ink and sent the boy north with the spare lantern and a loaf.",
)
INTRO = "\n\nRemember this note; you will be asked to repeat it word for word later: \""
CUE = "\"\n\nNow repeat the note, word for word: \""
CUE_WORDS = 3  # the cue gives the passage's first words, so the recall starts where the passage does


class WindowsError(ValueError):
    """A cache's full-precision windows are smaller than the ones its artifact chose."""


def check_windows(cache, strict: bool = True) -> dict:
    """Check that ``cache`` (an ``OscarCache``) keeps the full-precision windows its artifact chose.

    A calibrated artifact that chose its windows (``metadata["settings"]["chosen"]``: sink / recent) was scored with
    them; a cache built with smaller ones (an explicit ``config=OscarConfig(...)`` or ``recent=`` below
    the artifact's, a layer built with another config) quietly gives up quality that no fluency metric shows. Returns
    ``{"chosen": (sink, recent) or None, "cache": (sink, recent), "layers": {(sink, recent): [layers]}}``; raises
    :class:`WindowsError` (``strict``) or warns (``RuntimeWarning``) when the cache's or any quantized layer's sink or
    recent window is smaller than the artifact's, or a layer's differs from the cache's."""
    from oscar_hf.layer_choice import chosen_windows, window_shortfall

    cfg = cache.oscar_config
    rot = getattr(cache, "rotations", None)
    want = chosen_windows(rot, cfg)  # (the cache itself warns at construction: WindowsWarning)
    have = (cfg.sink, cfg.recent)
    layers: dict[tuple[int, int], list[int]] = {}
    for i, layer in enumerate(cache.layers):
        lc = getattr(layer, "config", None)
        if lc is not None and hasattr(lc, "sink") and hasattr(lc, "recent"):
            layers.setdefault((lc.sink, lc.recent), []).append(i)
    problems = [short] if (short := window_shortfall(cfg, rot)) else []
    for w, idx in layers.items():
        if w != have:
            problems.append(f"layers {idx} keep sink {w[0]} / recent {w[1]}, the cache says {have[0]} / {have[1]}")
    if problems:
        msg = "OSCAR windows are off: " + "; ".join(problems) + (
            ". Build the cache with OscarCache.from_pretrained(artifact, model) and no config, or pass the "
            "artifact's sink / recent.")
        if strict:
            raise WindowsError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=2)
    return {"chosen": want, "cache": have, "layers": {f"{s}/{r}": v for (s, r), v in layers.items()}}


def words(text: str) -> list[str]:
    return text.split()


@torch.no_grad()
def run_cache(model, cache, prompt: torch.Tensor, steps: torch.Tensor, target: torch.Tensor) -> list[int]:
    """Prefill ``prompt``, then ``steps`` (continuation and cue) and ``target`` (the rest of the passage), one decode
    step per token; returns the model's greedy choice at each target position (``[len(target)]``). Greedy decoding
    reproduces the passage exactly as far as these agree with ``target``, and writes the same rows until then."""
    from tqdm.auto import tqdm

    out = model(prompt, **cache_kwargs(model, cache), use_cache=True)
    feed = torch.cat([steps, target]).tolist()
    preds = []
    for i, t in enumerate(tqdm(feed, desc="decode steps", leave=False, mininterval=10)):
        if i >= len(steps):
            preds.append(int(out.logits[0, -1].argmax()))
            if preds[-1] != t:  # greedy decoding leaves the passage here: the rest is not recalled
                break
        out = model(torch.tensor([[t]]), **cache_kwargs(model, cache), use_cache=True)
    else:
        return preds
    return preds


def recall_score(tokenizer, passage: str, given: str, target: list[int], preds: list[int]) -> dict:
    """The greedy recall of ``passage`` (its first words ``given`` by the cue, then ``target`` token by token)
    against the model's choices ``preds``: ``exact`` (word for word), ``words_correct`` (passage words right before
    the first wrong token), ``recalled`` (the text up to and including the first wrong token)."""
    k = next((i for i, (p, t) in enumerate(zip(preds, target)) if p != t), len(preds))
    ok = given + tokenizer.decode(target[:k], skip_special_tokens=True)
    ends, pos = [], 0
    for w in words(passage):
        pos = passage.index(w, pos) + len(w)
        ends.append(pos)
    exact = k == len(target)
    n = len(ends) if exact else sum(e <= len(ok) and (e == len(passage) or passage[e] == " ") and e < len(ok)
                                    for e in ends)
    wrong = tokenizer.decode(preds[k:k + 1], skip_special_tokens=False) if not exact else ""
    return {"exact": exact, "words_correct": int(n), "words": len(ends), "tokens_correct": k,
            "tokens": len(target), "recalled": ok + (f"[{wrong}]" if wrong else "")}


def build_prompt(tokenizer, passage: str, prefix_ids: torch.Tensor):
    """``(prompt ids [1, T0], (p0, p1))``: held-out tokens, the intro and the passage; ``[p0, p1)``: the passage's
    token positions."""
    bos = tokenizer("a")["input_ids"][:1]  # the tokenizer's own BOS (Gemma's <bos>), if it adds one
    bos = bos if bos == [tokenizer.bos_token_id] else []
    head = bos + prefix_ids.tolist() + tokenizer(INTRO, add_special_tokens=False)["input_ids"]
    body = tokenizer(passage, add_special_tokens=False)["input_ids"]
    ids = head + body
    return torch.tensor([ids]), (len(head), len(ids))


@torch.no_grad()
def continuation(model, prompt: torch.Tensor, n: int, passage: str, tokenizer, seed: int) -> tuple[torch.Tensor, int]:
    """``([n] tokens, the seed that drew them)``: what BF16 samples after ``prompt`` (seeded; a draw that repeats 4
    words of the passage in a row is redrawn with the next seed, so the passage is recalled from the history, not
    from a fresh copy). The draw is reproducible within one environment only: another Transformers or torch build
    moves the logits by a rounding step, and a long sample then diverges (pass a run's ``continuation_ids`` back as
    ``continuations`` to repeat it exactly)."""
    from transformers import DynamicCache

    grams = {tuple(words(passage)[i:i + 4]) for i in range(len(words(passage)) - 3)}
    for s in range(seed, seed + 10):
        torch.manual_seed(s)
        out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                             **cache_kwargs(model, DynamicCache(config=model.config)), max_new_tokens=n,
                             min_new_tokens=n, do_sample=True, top_k=50, top_p=0.95, temperature=1.0,
                             pad_token_id=tokenizer.pad_token_id)
        cont = out[0, prompt.shape[1]:]
        w = words(tokenizer.decode(cont, skip_special_tokens=True))
        if not any(tuple(w[i:i + 4]) in grams for i in range(len(w) - 3)):
            return cont, s
    raise RuntimeError("every continuation drawn repeats the passage")


def probe(model, tokenizer, methods: dict, passages=PASSAGES, tokens: int = 720, prefix: int = 256,
          seed: int = 0, prefix_ids: torch.Tensor | None = None, continuations: list | None = None) -> dict:
    """Run the probe for every ``methods`` entry (name -> zero-argument function returning a fresh cache; the first
    is the reference, e.g. BF16 ``DynamicCache``) on each passage. Returns per passage: the layout (passage slots,
    prefill length, where the cue starts), the continuation's ids and seed, and each method's :func:`recall_score`
    and time. ``continuations`` (one list of ``tokens`` ids per passage, e.g. an earlier run's
    ``continuation_ids``) replaces the sampled ones, so a run can be repeated token for token."""
    if continuations is not None and (len(continuations) != len(passages)
                                      or any(len(c) != tokens for c in continuations)):
        raise ValueError(f"continuations: expected {len(passages)} lists of {tokens} token ids (one per passage), got "
                         f"{[len(c) for c in continuations]}")
    if prefix_ids is None:
        from .perplexity import evaluation_ids

        prefix_ids = evaluation_ids(tokenizer, prefix)
    res = []
    for k, passage in enumerate(passages):
        prompt, (p0, p1) = build_prompt(tokenizer, passage, prefix_ids[:prefix])
        given = " ".join(words(passage)[:CUE_WORDS])
        cue = torch.tensor(tokenizer(CUE + given, add_special_tokens=False)["input_ids"])
        full = tokenizer(CUE + passage, add_special_tokens=False)["input_ids"]
        if full[:len(cue)] != cue.tolist():
            raise ValueError("the cue's tokens are not a prefix of the cue + passage's: choose CUE_WORDS differently")
        target = torch.tensor(full[len(cue):])
        t_prefill, t_cue = prompt.shape[1], prompt.shape[1] + tokens
        caches, windows = {}, {}
        for name, make in methods.items():  # every layout is checked before anything runs
            caches[name] = cache = make()
            if hasattr(cache, "oscar_config"):
                windows[name] = check_windows(cache)
                s0, w = cache.oscar_config.sink, cache.oscar_config.recent
                if not (p0 >= s0 and p0 >= t_prefill - w):
                    raise ValueError(f"{name}: the passage (slots {p0}-{p1}) is not inside the recent window at "
                                     f"prefill (sink {s0}, recent {w}, prefill {t_prefill}): shorten the prefix")
                if p1 > t_cue - w:
                    raise ValueError(f"{name}: the passage (slots {p0}-{p1}) is still in the recent window when the "
                                     f"cue starts at {t_cue} (recent {w}): generate at least {p1 + w - t_prefill}")
        t0 = time.perf_counter()
        if continuations is None:
            cont, drawn = continuation(model, prompt, tokens, passage, tokenizer, seed + 100 * k)
        else:
            cont, drawn = torch.tensor(continuations[k], dtype=torch.long), None
        gen_s = time.perf_counter() - t0
        entry = {"passage": passage, "passage_slots": [p0, p1], "prefill_len": t_prefill, "cue_at": t_cue,
                 "generated": tokens, "seed": drawn, "continuation": tokenizer.decode(cont),
                 "continuation_ids": cont.tolist(), "continuation_s": round(gen_s, 1), "windows": windows,
                 "methods": {}}
        for name, cache in caches.items():
            t0 = time.perf_counter()
            preds = run_cache(model, cache, prompt, torch.cat([cont, cue]), target)
            r = recall_score(tokenizer, passage, given, target.tolist(), preds)
            r["time_s"] = round(time.perf_counter() - t0, 1)
            entry["methods"][name] = r
            print(f"passage {k} / {name}: exact {r['exact']}, {r['words_correct']}/{r['words']} words "
                  f"({r['time_s']} s): {r['recalled'][-60:]!r}", flush=True)
        res.append(entry)
    return {"passages": res,
            "summary": {name: {"exact": sum(e["methods"][name]["exact"] for e in res),
                               "words_correct": sum(e["methods"][name]["words_correct"] for e in res),
                               "words": sum(e["methods"][name]["words"] for e in res), "passages": len(res)}
                        for name in methods}}


def markdown(res: dict) -> str:
    names = list(res["summary"])
    lines = ["| cache | passages recalled word for word | words right before the first error |", "|---|---|---|"]
    for n in names:
        s = res["summary"][n]
        lines.append(f"| {n} | {s['exact']} / {s['passages']} | {s['words_correct']} / {s['words']} |")
    return "\n".join(lines) + "\n"


def main(argv=None, model=None, tokenizer=None):
    import argparse

    from oscar_hf import OscarCache
    from oscar_hf.eval.models import model_for_eval

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help='"smollm2" or "gemma3-270m"')
    p.add_argument("--artifact", required=True, help="calibrated artifact (scripts/calibrate.py --out)")
    p.add_argument("--tokens", type=int, default=720, help="tokens generated between the passage and the cue")
    p.add_argument("--prefix", type=int, default=256, help="held-out tokens before the passage")
    p.add_argument("--passages", type=int, default=len(PASSAGES))
    p.add_argument("--skip", type=int, default=0, help="passages left out before the first one probed")
    p.add_argument("--seed", type=int, default=0, help="passage k's continuation is drawn with seed + 100 k")
    p.add_argument("--continuations", default=None,
                   help="an earlier run's JSON: read its passages' continuation_ids instead of sampling")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--name", default="retention")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = p.parse_args(argv)
    if args.tokens < 700:
        warnings.warn("the probe is meant for >= 700 generated tokens", RuntimeWarning)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_load = time.perf_counter()
    model, tokenizer, model_name, dtype = model_for_eval(model, tokenizer, getattr(torch, args.dtype), args.model)
    from transformers import DynamicCache

    methods = {"BF16 DynamicCache": lambda: DynamicCache(config=model.config),
               "defaults (artifact)": lambda: OscarCache.from_pretrained(args.artifact, model)}
    load_s = time.perf_counter() - t_load
    t0 = time.perf_counter()
    passages = PASSAGES[args.skip:args.skip + args.passages]
    continuations = None
    if args.continuations:
        runs = json.loads(Path(args.continuations).read_text())["passages"]
        earlier = {e["passage"]: e.get("continuation_ids") for e in runs}
        missing = [p[:30] for p in passages if earlier.get(p) is None]
        if missing:
            raise ValueError(f"{args.continuations} holds no continuation_ids for the passages {missing}")
        continuations = [earlier[p] for p in passages]
    res = probe(model, tokenizer, methods, passages, tokens=args.tokens, prefix=args.prefix, seed=args.seed,
                continuations=continuations)
    res.update(command="python -P -m oscar_hf.eval.retention " + " ".join(argv if argv is not None else sys.argv[1:]),
               setup=dict(model=model_name, dtype=str(dtype).removeprefix("torch."), artifact=args.artifact,
                          config=OscarCache.from_pretrained(args.artifact, model).oscar_config.to_dict(),
                          threads=torch.get_num_threads(), load_s=round(load_s, 1),
                          probe_s=round(time.perf_counter() - t0, 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(res, indent=1))
    md = (f"Command: `{res['command']}`\n\nModel: {model_name}, {res['setup']['dtype']}; {args.tokens} tokens "
          f"sampled by BF16 between the passage (in the recent window at prefill) and the cue; "
          f"{res['setup']['probe_s']} s on {res['setup']['threads']} thread(s).\n\n" + markdown(res))
    (out / f"{args.name}.md").write_text(md)
    print(md)
    return res


if __name__ == "__main__":
    main()
