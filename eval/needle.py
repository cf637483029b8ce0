"""RULER-style single needle in a haystack, read through a KV cache.

A key/value pair is inserted at a relative depth of a haystack, followed by a question. Because
OscarCache's prefill is exact on the prompt, the haystack is the prefill and the question is fed
token by token as decode steps: every question token and every answer token reads the needle from
the cache under test (INT2 history once it left the recent window). The answer is greedy.

Two needle formats (:data:`FORMATS`):

* ``magic-number`` (RULER): "The special magic number for <key> is: <7 digits>." in held-out WikiText
  (or a repeated filler);
* ``locker`` (unseen): "Archive memo: the <colour> <animal> locker opens with combination <ABCD-12345>."
  in the prose of the Python language reference (``pydoc_data.topics``, stdlib, offline). Neither its
  wording (no common word 4-gram), its values (letters + 5 digits) nor its haystack is what calibration's
  retrieval-head probes (:mod:`oscar_hf.calibration.retrieval_heads`: access codes of people, 7 digits,
  WikiText's calibration part) or the magic-number needle use, so a cache tuned on those probes is
  scored on text it never saw. The command line and reports: :mod:`oscar_hf.eval.needle_cli`.

    python -P scripts/eval_needle.py --lengths 1024,2048,4096 --depths 0,0.5,1 --methods fp,oscar
    python -P scripts/eval_needle.py --format locker --haystack pydoc --methods fp,default --share-prefill \\
        --lengths 1024,2048,4096,8176 --depths 0.1,0.3,0.5,0.7,0.9 --trials 3 --hay-stride 997
"""
from __future__ import annotations

import copy
import random
import re
import string
from collections.abc import Callable
from dataclasses import dataclass

import torch

from oscar_hf.compat import cache_kwargs

from .haystack import bos_ids

NEEDLE = "The special magic number for {key} is: {value}."
QUESTION = " What is the special magic number for {key} mentioned in the provided text? The special magic number for {key} mentioned in the provided text is:"
KEYS = ("amber-falcon", "quiet-river", "silver-maple", "bright-harbor", "cold-meadow", "lucky-otter", "red-lantern")

# The unseen format: words, keys and value shape shared with neither the magic-number needle nor the probes.
LOCKER_NEEDLE = "Archive memo: the {key} locker opens with combination {value}."
LOCKER_QUESTION = " Which combination opens the {key} locker? Answer: the {key} locker opens with combination"
COLOURS = ("crimson", "violet", "teal", "ochre", "indigo", "scarlet", "olive", "ivory")
ANIMALS = ("badger", "heron", "lynx", "walrus", "gecko", "bison", "puffin", "marten")
CODE_LETTERS = "".join(c for c in string.ascii_uppercase if c not in "IO")  # no I/O: never read as 1/0


def score_answer(text: str, value: str) -> bool:
    """True iff the first number in the answer is exactly ``value``."""
    m = re.search(r"\d[\d,]*", text)
    return m is not None and m.group(0).replace(",", "") == value


def score_code(text: str, value: str) -> bool:
    """True iff the first code-shaped word of the answer (letters, optional hyphen, digits) is exactly ``value``
    (case and hyphen included: a copied code is exact or wrong)."""
    m = re.search(r"(?<![A-Za-z0-9])[A-Za-z]+-?\d+", text)
    return m is not None and m.group(0) == value


def _seven_digits(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _locker_code(rng: random.Random) -> str:
    """4 letters, a hyphen, 5 digits (leading zeros kept), e.g. ``"KVRT-04813"``."""
    return "".join(rng.choice(CODE_LETTERS) for _ in range(4)) + "-" + f"{rng.randrange(100_000):05d}"


@dataclass(frozen=True)
class NeedleFormat:
    """How a needle is written, asked for, drawn and scored. ``needle`` / ``question``: templates with
    ``{key}`` (and ``{value}``); ``draw_value(rng)``; ``score(answer_text, value)``; ``max_new_tokens``: greedy
    answer budget (a locker code is ~9 SmolLM2 tokens)."""

    name: str
    needle: str
    question: str
    keys: tuple[str, ...]
    draw_value: Callable[[random.Random], str]
    score: Callable[[str, str], bool]
    max_new_tokens: int = 10

    def draw(self, rng: random.Random) -> tuple[str, str]:
        """``(key, value)``: key first, then value (the magic-number format's historical draw order)."""
        key = rng.choice(self.keys)
        return key, self.draw_value(rng)


MAGIC_NUMBER = NeedleFormat("magic-number", NEEDLE, QUESTION, KEYS, _seven_digits, score_answer, 10)
LOCKER = NeedleFormat("locker", LOCKER_NEEDLE, LOCKER_QUESTION, tuple(f"{c} {a}" for c in COLOURS for a in ANIMALS),
                      _locker_code, score_code, 14)
FORMATS = {f.name: f for f in (MAGIC_NUMBER, LOCKER)}


def make_needle_prompt(tokenizer, haystack_ids: torch.Tensor, length: int, depth: float, key: str, value: str,
                       fmt: NeedleFormat = MAGIC_NUMBER, offset: int = 0):
    """``(context_ids, question_ids, needle_start)``: ``context`` = :func:`bos_ids`, then the haystack (from token
    ``offset`` on) with the needle at ``depth`` (0 = first haystack token, 1 = just before the question);
    ``len(context) + len(question) == length``."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth}")
    if offset < 0:
        raise ValueError(f"haystack offset must be >= 0, got {offset}")
    enc = lambda s: torch.tensor(tokenizer(s, add_special_tokens=False)["input_ids"], dtype=torch.long)  # noqa: E731
    needle = enc(" " + fmt.needle.format(key=key, value=value) + " ")
    question = enc(fmt.question.format(key=key))
    head = torch.tensor(bos_ids(tokenizer), dtype=torch.long)
    n_hay = length - len(head) - len(needle) - len(question)
    if n_hay < 0 or haystack_ids.numel() < offset + n_hay:
        raise ValueError(f"length {length} too short for the needle/question or haystack too small "
                         f"({haystack_ids.numel()} tokens, {offset + max(n_hay, 0)} needed)")
    hay = haystack_ids.reshape(-1)[offset : offset + n_hay]
    at = int(round(depth * n_hay))
    return torch.cat([head, hay[:at], needle, hay[at:]]), question, len(head) + at


@torch.no_grad()
def prefill_kv(model, context: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(keys, values) [1, Hk, n, D]`` of one exact prefill of ``context [n]`` (a DynamicCache).
    :func:`write_prefix` hands them to each method's fresh cache: the methods of a needle share one prefill."""
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    model(context[None].to(dev), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


def write_prefix(cache, prefix_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Store a prefilled prefix in the fresh ``cache`` as the prefill forward would: an OSCAR layer through its
    write path (``write``: sink, recent window, INT2 history; OscarCache's prefill attention is exact, so its
    K/V rows are those of any exact prefill), a full-precision ``DynamicLayer`` by ``update``. Other layer
    kinds (sliding windows, Transformers' quantized layers) raise ValueError: prefill those through the model."""
    from transformers.cache_utils import DynamicLayer

    from oscar_hf.cache import OscarLayer

    if len(cache.layers) != len(prefix_kv):
        raise ValueError(f"cache has {len(cache.layers)} layers, prefix {len(prefix_kv)}")
    for i, (layer, (k, v)) in enumerate(zip(cache.layers, prefix_kv)):
        if getattr(layer, "is_initialized", False):
            raise ValueError(f"layer {i} already holds tokens: write_prefix needs a fresh cache")
        if isinstance(layer, OscarLayer):
            layer.write(k, v)
        elif type(layer) is DynamicLayer:  # noqa: E721 (subclasses such as sliding windows drop tokens)
            layer.update(k, v)
        else:
            raise ValueError(f"layer {i}: cannot write a shared prefix into a {type(layer).__name__}")


def _prefilled(model, context, make_cache, prefix_kv=None):
    """A fresh cache holding ``context``: prefilled through the model, or written from ``prefix_kv``."""
    cache = make_cache()
    if prefix_kv is None:
        dev = next(model.parameters()).device
        model(context[None].to(dev), **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    else:
        write_prefix(cache, prefix_kv)
    return cache


@torch.no_grad()
def answer(model, tokenizer, context, question, make_cache, max_new_tokens: int = 10, prefix_kv=None) -> str:
    """Greedy answer after ``context`` (prefill, or ``prefix_kv`` of :func:`prefill_kv`) and ``question``
    (decode steps: every question token reads the needle through the cache)."""
    if len(question) == 0:
        raise ValueError("the question must have at least one token (its last one predicts the answer)")
    dev = next(model.parameters()).device
    cache = _prefilled(model, context, make_cache, prefix_kv)
    for t in question:
        out = model(t.view(1, 1).to(dev), **cache_kwargs(model, cache), use_cache=True)
    new = []
    for _ in range(max_new_tokens):
        nxt = out.logits[0, -1].argmax()
        if nxt.item() == tokenizer.eos_token_id:
            break
        new.append(nxt.item())
        if len(new) < max_new_tokens:
            out = model(nxt.view(1, 1), **cache_kwargs(model, cache), use_cache=True)
    return tokenizer.decode(new, skip_special_tokens=True)


@torch.no_grad()
def answer_nll(model, tokenizer, context, question, value: str, make_cache, prefix_kv=None) -> tuple[float, int]:
    """``(nll, n)``: negative log-likelihood (nats, summed) of the right answer ``" <value>"`` teacher-forced
    after the question, read through the cache like :func:`answer`; ``n`` answer tokens. A continuous
    retrieval score: far less noisy than exact-match accuracy on a handful of needles."""
    if len(question) == 0:
        raise ValueError("the question must have at least one token (its last one predicts the answer)")
    dev = next(model.parameters()).device
    target = torch.tensor(tokenizer(" " + value, add_special_tokens=False)["input_ids"])
    cache = _prefilled(model, context, make_cache, prefix_kv)
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
        # each method reads a copy of the exact prefix (a sliding-window layer cannot be cropped back to it)
        past = copy.deepcopy(cache)
        with fake_quant(model, spec, prefill_len=n_ctx):
            logits = model(seq, **cache_kwargs(model, past), use_cache=True).logits[0, n_q - 1 :].float()
        logp = torch.log_softmax(logits, -1)
        tgt = target.to(logits.device)
        out[name] = dict(nll=float(-logp.gather(1, tgt[:, None]).sum()), n_answer_tokens=len(target),
                         argmax_correct=bool((logits.argmax(-1) == tgt).all()))
    return out


def make_cells(lengths, depths, trials: int = 1, seed: int = 0, fmt: NeedleFormat = MAGIC_NUMBER) -> list[tuple]:
    """``(length, depth, key, value)`` per trial; the same cells (needles) for every method."""
    rng = random.Random(seed)  # trial-major: a run cut short still covers every (length, depth) once
    return [(L, d, *fmt.draw(rng)) for _ in range(trials) for L in lengths for d in depths]


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


@dataclass(frozen=True)
class GridOptions:
    """How :func:`run_grid` draws and scores its cells. ``trials`` needles per (length, depth), drawn from
    ``seed``; ``run_depths`` / ``run_lengths``: only these depths / lengths are run, on the needles the full grid
    draws (so a run of the interior depths, or of one length, meets the same needles as a full run);
    ``score="nll"``: instead of generating, record the teacher-forced NLL of the right answer (:func:`answer_nll`);
    ``fmt``: the needle format; ``hay_stride``: trial ``t`` reads the haystack from token ``t * hay_stride`` on
    (distinct text around each needle);
    ``share_prefill``: one exact prefill per needle written into every method's cache (:func:`write_prefix`)
    instead of one prefill per method (same caches, a fraction of the time); ``progress``: a tqdm bar."""

    trials: int = 1
    seed: int = 0
    run_depths: tuple[float, ...] | None = None
    run_lengths: tuple[int, ...] | None = None
    score: str = "generate"
    fmt: NeedleFormat = MAGIC_NUMBER
    hay_stride: int = 0
    share_prefill: bool = False
    progress: bool = True

    def __post_init__(self):
        if self.score not in ("generate", "nll"):
            raise ValueError(f"score must be 'generate' or 'nll', got {self.score!r}")
        if self.hay_stride < 0:
            raise ValueError(f"hay_stride must be >= 0, got {self.hay_stride}")
        if self.trials < 1:
            raise ValueError(f"trials must be >= 1, got {self.trials}")


def run_grid(model, tokenizer, haystack_ids, methods: dict, lengths, depths, opts: GridOptions = GridOptions(),
             done: list[dict] | None = None, on_result=None) -> dict:
    """``{"accuracy": {method: {length: {depth: accuracy}}}, "nll": ..., "answers": [...]}``.

    Cells (needle position and value) are shared by all methods; every cell runs all methods before the next
    one, so a shortened run still compares the methods on the same needles. ``opts``: :class:`GridOptions`;
    ``done``: raw records of an earlier run (resumed: cells already answered are not run again);
    ``on_result(raw)`` after each answer.
    """
    from tqdm.auto import tqdm

    score, fmt, hay_stride = opts.score, opts.fmt, opts.hay_stride
    cells = make_cells(lengths, depths, opts.trials, opts.seed, fmt)
    for i, only, grid in ((0, opts.run_lengths, lengths), (1, opts.run_depths, depths)):  # (length, depth, ...)
        if only is not None:
            if not set(only) <= set(grid):  # else no cell would run, silently
                raise ValueError(f"run_{('lengths', 'depths')[i]} {sorted(only)} must be among {list(grid)}")
            cells = [c for c in cells if c[i] in set(only)]
    raw = list(done or [])
    seen = {(r["method"], r["length"], r["depth"], r["value"], r.get("trial", 0)) for r in raw
            if ("nll" in r) == (score == "nll")}
    trial_of = {}
    bar = tqdm(total=len(cells) * len(methods), desc="needle", disable=not opts.progress)
    for L, d, key, value in cells:
        t = trial_of[(L, d)] = trial_of.get((L, d), -1) + 1
        offset = t * hay_stride
        ctx, q, at = make_needle_prompt(tokenizer, haystack_ids, L, d, key, value, fmt, offset)
        todo = [name for name in methods if (name, L, d, value, t) not in seen]
        prefix = prefill_kv(model, ctx) if opts.share_prefill and todo else None
        for name, method in methods.items():
            bar.set_postfix_str(f"L={L} depth={d:.2f} {name}")
            if name in todo:
                rec = dict(method=name, length=L, depth=d, trial=t, key=key, value=value, needle_at=at)
                if hay_stride:
                    rec["haystack_offset"] = offset
                make = lambda: method.make_cache(model)  # noqa: E731
                if score == "nll":
                    nll, n = answer_nll(model, tokenizer, ctx, q, value, make, prefix_kv=prefix)
                    rec.update(nll=nll, n_answer_tokens=n)
                else:
                    a = answer(model, tokenizer, ctx, q, make, fmt.max_new_tokens, prefix_kv=prefix)
                    rec.update(answer=a, correct=fmt.score(a, value))
                raw.append(rec)
                if on_result is not None:
                    on_result(raw)
            bar.update()
    bar.close()
    keep = {(n, L, d, v) for L, d, _, v in cells for n in methods}
    raw = [r for r in raw if (r["method"], r["length"], r["depth"], r["value"]) in keep]
    return {"accuracy": accuracy_table(raw), "nll": nll_table(raw), "answers": raw}


def history_bits(cache) -> dict:
    """The history's average bits per element over the quantized layers' KV heads, the retrieval heads counted
    as the cache stores them (``OscarConfig.retrieval_head_bits``: 8.5 at INT8, D = 64) and the rest at the INT2
    rows' cost (2.5 bits at group 64): ``cache.memory_report()``'s figure. ``{}`` for a cache without OSCAR layers."""
    layers = [layer for layer in getattr(cache, "layers", ()) if hasattr(layer, "retrieval_heads")]
    if not layers or not hasattr(cache, "oscar_config"):
        return {}
    fp, c = cache.fingerprint, cache.oscar_config
    n = len(layers) * fp.num_key_value_heads
    p = sum(len(layer.retrieval_heads) for layer in layers)
    return dict(retrieval_heads=p, kv_heads=n, retrieval_head_bits=c.retrieval_head_bits(fp.head_dim),
                history_bits=c.history_bits(fp.head_dim, p / n))
