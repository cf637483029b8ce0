"""RULER-style synthetic long-context samples (Hsieh et al. 2024), generated offline from any text file.

Four tasks (:data:`TASKS`), prompts worded as RULER's:

* ``niah_multikey``: 4 needles "One of the special magic numbers for <key> is: <7 digits>." (4 keys) in the
  haystack; one key is asked, its number is the gold.
* ``niah_multivalue``: 4 needles of ONE key with 4 different numbers; all four are asked (and gold).
* ``vt`` (variable tracking): a chain ``VAR A = 12345. ... VAR B = VAR A. ... VAR E = VAR D.`` (4 hops) spread
  through the haystack; "find all variables assigned the value 12345": the 5 names are gold.
* ``cwe`` (common-word extraction): a numbered list of words (no haystack prose) where 10 words occur 6 times
  and the others once (30 / 3 times from 4K on), after one worked example; the 10 frequent words are gold.

The haystack is the held-out part of a text file (``oscar_hf.data.split_texts(...).evaluation``: the first
~25 % that calibration reads is never used; default file: WikiText-2 raw test, ``oscar_hf.eval.models.wikitext_path``
or ``OSCAR_WIKITEXT``); needle keys and CWE words are lower-case words of that text. A sample of length ``L`` has
``L - GEN_TOKENS[task]`` prompt tokens or a few fewer (the model's tokenizer counts them, special tokens
included), so prompt + answer budget fit in ``L`` (RULER's convention). Everything is drawn from
``random.Random(f"{task}/{length}/{seed}/{index}")``: the same arguments give the same samples anywhere.

Score (RULER's ``string_match_all``): the fraction of gold strings found, case-insensitively, in the greedy
generation. The local lm-eval tasks are ``eval/tasks/ruler_local_*.yaml``; ``scripts/eval_ruler.py`` writes
samples to JSONL.
"""
from __future__ import annotations

import random
import re
import string
from dataclasses import asdict, dataclass
from pathlib import Path

TASKS = ("niah_multikey", "niah_multivalue", "vt", "cwe")
GEN_TOKENS = {"niah_multikey": 32, "niah_multivalue": 64, "vt": 32, "cwe": 64}  # greedy answer budgets

_NIAH_INTRO = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the numbers afterwards.\n")
_NEEDLE = "One of the special magic numbers for {key} is: {value}."
_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_CWE_INTRO = ("Below is a numbered list of words. In these words, some appear more often than others. "
              "Memorize the ones that appear most often.\n")
_CWE_QUESTION = "Question: What are the {k} most common words in the above list?"
_CWE_PREFIX = "Answer: The top {k} words that appear most often in the list are:"


@dataclass(frozen=True)
class Sample:
    """One sample. ``input``: instruction + context + question; ``gen_prefix``: the start of the answer
    (``prompt = input + " " + gen_prefix`` is what the model continues, or ``gen_prefix`` opens the assistant
    turn under a chat template); ``answers``: gold strings; ``n_tokens``: tokens of ``prompt`` (special tokens
    included), at most ``length - GEN_TOKENS[task]``."""

    task: str
    length: int
    index: int
    input: str
    gen_prefix: str
    answers: list[str]
    n_tokens: int

    @property
    def prompt(self) -> str:
        return f"{self.input} {self.gen_prefix}"

    def as_doc(self) -> dict:
        return asdict(self)


def score(prediction: str, answers: list[str]) -> float:
    """Fraction of ``answers`` contained in ``prediction`` (case-insensitive substring, RULER's string_match_all)."""
    if not answers:
        raise ValueError("score needs at least one gold answer")
    pred = prediction.lower()
    return sum(a.lower() in pred for a in answers) / len(answers)


# ---------------------------------------------------------------------------------------------- haystack
class Haystack:
    """The held-out part of a text file: ``text``, its token ids ``ids`` (no special tokens) under one tokenizer,
    and ``words``: its distinct lower-case words of 5-12 letters, sorted (needle keys, CWE lists)."""

    def __init__(self, tokenizer, path: str | Path | None = None):
        from oscar_hf.data import split_texts
        from oscar_hf.eval.models import wikitext_path

        self.path = Path(path) if path else wikitext_path()
        if not self.path.is_file():
            raise OSError(f"haystack file {self.path} not found")
        self.text = split_texts(self.path.read_text(encoding="utf-8")).evaluation
        self.tokenizer = tokenizer
        self.ids = tokenizer(self.text, add_special_tokens=False)["input_ids"]
        self.words = sorted(set(re.findall(r"\b[a-z]{5,12}\b", self.text)))

    def count(self, prompt: str) -> int:
        return len(self.tokenizer(prompt)["input_ids"])

    def window(self, start: int, n: int) -> str:
        return self.tokenizer.decode(self.ids[start:start + n]).strip()


def _fit(build, count, budget: int, n_max: int, what: str):
    """``(prompt_parts, n_tokens)`` of ``build(n)`` for the largest ``n`` in ``[0, n_max]`` whose prompt has at most
    ``budget`` tokens (bisection; ``build(n)`` returns ``(input, gen_prefix)`` and grows with ``n``)."""
    def tokens(n):
        parts = build(n)
        return parts, count(f"{parts[0]} {parts[1]}")

    best = tokens(0)
    if best[1] > budget:
        raise ValueError(f"{what}: the prompt without any filler has {best[1]} tokens, over the budget of {budget}; "
                         "use a longer length")
    top = tokens(n_max)
    if top[1] <= budget:
        return top
    lo, hi = 0, n_max  # tokens(lo) fits, tokens(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = tokens(mid)
        if got[1] <= budget:
            lo, best = mid, got
        else:
            hi = mid
    return best


def _insert(text: str, items: list[str], depths: list[float]) -> str:
    """``text`` with ``items`` inserted in order, each at the first sentence end (". ") at or after its relative
    depth (else the next space), ``depths`` ascending in [0, 1]."""
    out, prev = [], 0
    for item, d in zip(items, depths):
        pos = max(prev, int(d * len(text)))
        j = text.find(". ", pos)
        at = j + 2 if 0 <= j < pos + 400 else (text.find(" ", pos) + 1 or len(text))
        gap = " " if at and not text[at - 1].isspace() else ""
        out += [text[prev:at], gap, item, " "]
        prev = at
    out.append(text[prev:])
    return "".join(out).strip()


def _hay_start(hay: Haystack, rng: random.Random, budget: int, what: str) -> int:
    if len(hay.ids) <= budget:
        raise ValueError(f"{what}: haystack {hay.path} has {len(hay.ids)} held-out tokens; a sample needs more than "
                         f"{budget}")
    return rng.randrange(len(hay.ids) - budget)


def _keys(rng: random.Random, words: list[str], n: int) -> list[str]:
    keys = []
    while len(keys) < n:
        key = "-".join(rng.sample(words, 2))
        keys += [key] if key not in keys else []
    return keys


def _numbers(rng: random.Random, n: int, lo: int, hi: int) -> list[str]:
    return [str(v) for v in rng.sample(range(lo, hi), n)]


def _niah(hay, rng, budget, what, num_keys: int, num_values: int):
    keys = _keys(rng, hay.words, num_keys)
    values = [_numbers(rng, num_values, 1_000_000, 10_000_000) for _ in keys]
    needles = [_NEEDLE.format(key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    depths = sorted(rng.random() for _ in needles)
    q = rng.randrange(num_keys)
    key, gold = keys[q], values[q]
    if num_values == 1:
        question = f"What is the special magic number for {key} mentioned in the provided text?"
        prefix = f"Answer: The special magic number for {key} mentioned in the provided text is"
    else:
        question = f"What are all the special magic numbers for {key} mentioned in the provided text?"
        prefix = f"Answer: The special magic numbers for {key} mentioned in the provided text are"
    start = _hay_start(hay, rng, budget, what)

    def build(n):
        return f"{_NIAH_INTRO}{_insert(hay.window(start, n), needles, depths)}\n{question}", prefix

    return build, budget, gold


def _vt(hay, rng, budget, what, num_chains: int = 1, num_hops: int = 4):
    names = []  # a list, never a set: set order changes with PYTHONHASHSEED, the samples must not
    while len(names) < num_chains * (num_hops + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        names += [name] if name not in names else []
    values = _numbers(rng, num_chains, 10_000, 100_000)
    chains = []
    for c in range(num_chains):
        var = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        chains.append((var, [f"VAR {var[0]} = {values[c]}."] + [f"VAR {b} = VAR {a}." for a, b in zip(var, var[1:])]))
    # each chain in order at its own ascending depths; chains interleave
    placed = sorted((d, i, s) for i, (_, stmts) in enumerate(chains)
                    for d, s in zip(sorted(rng.random() for _ in stmts), stmts))
    items, depths = [s for _, _, s in placed], [d for d, _, _ in placed]
    gold = chains[0][0]
    question = f"Question: Find all variables that are assigned the value {values[0]} in the text above."
    prefix = (f"Answer: According to the chain(s) of variable assignment in the text above, {len(gold)} variables "
              f"are assigned the value {values[0]}, they are:")
    start = _hay_start(hay, rng, budget, what)

    def build(n):
        return f"{_VT_INTRO}{_insert(hay.window(start, n), items, depths)}\n{question}", prefix

    return build, budget, gold


def _cwe(hay, rng, budget, what, length: int, num_common: int = 10):
    freq_c, freq_u = (6, 1) if length < 4096 else (30, 3)  # RULER's frequencies (below / from 4K)
    ex_c, ex_u, ex_n = (3, 1, 20) if length < 4096 else (10, 3, 40)  # its worked example
    pool = rng.sample(hay.words, len(hay.words))
    shuffle_seed = rng.random()
    common, ex_words = [], []
    for w in pool:  # no chosen word may contain another (substring scoring)
        if len(common) + len(ex_words) >= num_common + ex_n:
            break
        if not any(w in c or c in w for c in common + ex_words):
            (common if len(common) < num_common else ex_words).append(w)
    rest = [w for w in pool if w not in common and w not in ex_words and not any(c in w for c in common)]
    if len(common) < num_common or len(ex_words) < ex_n:
        raise ValueError(f"{what}: {hay.path} has too few distinct words ({len(hay.words)}) for the CWE lists")

    def numbered(words, k, gen):
        lst = words[:k] * (freq_c if gen is None else gen[0]) + words[k:] * (freq_u if gen is None else gen[1])
        random.Random(f"{shuffle_seed}/{len(words)}").shuffle(lst)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))

    ex_common = ex_words[:num_common]
    example = (f"{_CWE_INTRO}{numbered(ex_words, num_common, (ex_c, ex_u))}\n{_CWE_QUESTION.format(k=num_common)} "
               f"{_CWE_PREFIX.format(k=num_common)} " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common)))
    question, prefix = _CWE_QUESTION.format(k=num_common), _CWE_PREFIX.format(k=num_common)

    def build(n):
        return f"{example}\n{_CWE_INTRO}{numbered(common + rest[:n], num_common, None)}\n{question}", prefix

    return build, min(len(rest), budget // freq_u), common


def make_sample(task: str, tokenizer_or_hay, length: int, index: int = 0, seed: int = 0,
                haystack: str | Path | None = None) -> Sample:
    """One :class:`Sample` of ``task`` at ``length`` tokens (prompt + ``GEN_TOKENS[task]``). ``tokenizer_or_hay``: the
    model's tokenizer, or a :class:`Haystack` built on it (reused across samples: tokenizing the text is the
    slow part). Raises ValueError when the length cannot hold the task's fixed text or the haystack is too short."""
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; known: {', '.join(TASKS)}")
    hay = tokenizer_or_hay if isinstance(tokenizer_or_hay, Haystack) else Haystack(tokenizer_or_hay, haystack)
    length = int(length)
    budget = length - GEN_TOKENS[task]
    what = f"{task} at length {length}"
    if budget <= 0:
        raise ValueError(f"{what}: the length must exceed the answer budget of {GEN_TOKENS[task]} tokens")
    rng = random.Random(f"{task}/{length}/{seed}/{index}")
    if task == "niah_multikey":
        build, n_max, gold = _niah(hay, rng, budget, what, num_keys=4, num_values=1)
    elif task == "niah_multivalue":
        build, n_max, gold = _niah(hay, rng, budget, what, num_keys=1, num_values=4)
    elif task == "vt":
        build, n_max, gold = _vt(hay, rng, budget, what)
    else:
        build, n_max, gold = _cwe(hay, rng, budget, what, length)
    (inp, prefix), n_tokens = _fit(build, hay.count, budget, n_max, what)
    return Sample(task, length, index, inp, prefix, list(gold), n_tokens)


def make_samples(task: str, tokenizer_or_hay, lengths, samples: int, seed: int = 0,
                 haystack: str | Path | None = None) -> list[Sample]:
    """``samples`` samples per length, index-major (``--limit k * len(lengths)`` covers every length evenly)."""
    hay = tokenizer_or_hay if isinstance(tokenizer_or_hay, Haystack) else Haystack(tokenizer_or_hay, haystack)
    return [make_sample(task, hay, L, i, seed) for i in range(int(samples)) for L in lengths]


# ---------------------------------------------------------------------------------------------- CLI
def results_table(paths) -> str:
    """Markdown table of lm-eval results files (``--output_path`` JSON) of ``ruler_local`` runs: one row per
    model and length, the four task scores and the suite mean, in percent."""
    import json

    rows = ["| model | length | " + " | ".join(TASKS) + " | mean |", "|---|---:|" + "---:|" * (len(TASKS) + 1)]
    for path in paths:
        res = json.loads(Path(path).read_text())
        cfg = res.get("config", {})
        args = cfg.get("model_args", "")
        args = args if isinstance(args, str) else ",".join(f"{k}={v}" for k, v in args.items())
        method = dict(kv.split("=", 1) for kv in args.split(",") if "=" in kv).get("method")
        label = cfg.get("model", "?") + (f" ({method})" if method else "")
        lengths = sorted({int(k.split(",")[0]) for t in res["results"].values() for k in t
                          if k.split(",")[0].isdigit() and "_stderr" not in k})
        for L in lengths:
            cells = [res["results"].get(f"ruler_local_{t}", {}).get(f"{L},none") for t in TASKS]
            mean = res["results"].get("ruler_local", {}).get(f"{L},none")
            rows.append(f"| {label} | {L} | " + " | ".join("-" if c is None else f"{100 * c:.1f}"
                                                          for c in [*cells, mean]) + " |")
    return "\n".join(rows)


def main(argv=None) -> int:
    """``scripts/eval_ruler.py``: write samples as JSONL (to read what the model is asked), or tabulate results."""
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(description="RULER-style samples (eval/ruler.py) and result tables")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("samples", help="write samples as JSONL, one per line (fields of Sample + prompt)")
    s.add_argument("--tokenizer", default="smollm2", help="tokenizer name / path (smollm2: the packaged GGUF)")
    s.add_argument("--tasks", default=",".join(TASKS))
    s.add_argument("--lengths", default="4096")
    s.add_argument("--samples", type=int, default=1)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--haystack", default=None, help="text file (default: WikiText-2 raw test)")
    s.add_argument("--out", default="-")
    t = sub.add_parser("table", help="markdown table of lm-eval results JSON files of ruler_local runs")
    t.add_argument("results", nargs="+")
    args = p.parse_args(argv)
    if args.cmd == "table":
        print(results_table(args.results))
        return 0
    from transformers import AutoTokenizer

    from oscar_hf.eval.models import DEFAULT_MODEL, SMOLLM2_GGUF, smollm2_dir

    kw = dict(gguf_file=SMOLLM2_GGUF) if args.tokenizer == DEFAULT_MODEL else {}
    tok = AutoTokenizer.from_pretrained(str(smollm2_dir()) if kw else args.tokenizer, **kw)
    hay = Haystack(tok, args.haystack)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = sys.stdout if args.out == "-" else open(args.out, "w", encoding="utf-8")
    try:
        for task in args.tasks.split(","):
            for smp in make_samples(task, hay, lengths, args.samples, args.seed):
                out.write(json.dumps(dict(smp.as_doc(), prompt=smp.prompt)) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    return 0
