"""Perplexity with true cache semantics: every scored token sees exactly what it would see while
decoding with the cache (sink and recent in full precision, the rest from INT2 history).

* :func:`cache_nll` prefills ``context`` tokens through the cache, then feeds the scored tokens one
  at a time (teacher forcing), so each prediction is made by a decode step of the cache under test.
  The reference: slow (one forward per token), works for any ``Cache``.
* :func:`fast_nll` computes the same numbers in ONE forward with a fake-quant spec
  (:mod:`oscar_hf.eval.fakequant`); ``tests/eval/test_perplexity.py`` proves the two equal.
* :func:`perplexity` runs a method (:mod:`oscar_hf.eval.methods`) over ``n_windows`` consecutive
  windows of held-out text, fast path when the method has one, token by token otherwise.

Held-out text: :func:`evaluation_ids` takes the second half of the file's characters, which lies
inside ``oscar_hf.data``'s evaluation part (everything after the first ~25 %) and is also disjoint
from ``scripts/demo.py``'s calibration slice (the first third).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from oscar_hf.compat import cache_kwargs

from .fakequant import FakeQuantSpec, fake_quant

EVAL_START_FRACTION = 0.5


def _scored_ids(model, input_ids: torch.Tensor, context_len: int):
    """``input_ids`` on the model's device and its length, checking that some token is scored."""
    n = input_ids.shape[1]
    if not 0 < context_len < n:
        raise ValueError(f"context_len={context_len} must lie in (0, {n})")
    return input_ids.to(next(model.parameters()).device), n


def _bar_disabled(progress: bool) -> bool:
    return not progress or not hf_logging.is_progress_bar_enabled()


@torch.no_grad()
def decode_logits(model, ids: torch.Tensor, context_len: int, cache, progress: bool = True, desc: str = "scoring"):
    """Yields the next-token logits ``[B, V]`` (model dtype) predicting ``ids[:, t]`` for ``t`` in ``[context_len, n)``:
    the prefill's last position first, then one decode step of ``cache`` per token.

    ``ids`` ``[B, n]`` on the model's device; ``ids[:, t]`` is read only after the logits predicting it were
    yielded, so a consumer may write it first (greedy generation).
    """
    n = ids.shape[1]
    logits = model(ids[:, :context_len], **cache_kwargs(model, cache), use_cache=True).logits[:, -1]
    for t in tqdm(range(context_len, n), desc=desc, disable=_bar_disabled(progress), leave=False):
        yield logits
        if t + 1 < n:
            logits = model(ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits[:, -1]


@torch.no_grad()
def cache_nll(
    model,
    input_ids: torch.Tensor,
    context_len: int,
    make_cache: Callable[[], object],
    progress: bool = True,
    desc: str = "scoring",
    return_token_nll: bool = False,
) -> dict:
    """Mean NLL / perplexity of ``input_ids[:, context_len:]`` given the prefix, one decode step per token.

    ``input_ids`` is ``[1, n]``; ``make_cache()`` returns a fresh cache (``DynamicCache``, ``OscarCache``, ...).
    With ``return_token_nll`` the per-token NLLs (float64 tensor ``[n - context_len]``) are returned too.
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("cache_nll scores one sequence: input_ids must be [1, n]")
    ids, n = _scored_ids(model, input_ids, context_len)
    cache = make_cache()
    steps = decode_logits(model, ids, context_len, cache, progress, desc)
    token_nll = [F.cross_entropy(logits.float(), ids[:, t]).item() for t, logits in zip(range(context_len, n), steps)]
    nll = sum(token_nll) / (n - context_len)
    res = {"nll": nll, "ppl": math.exp(nll), "tokens": n - context_len, "cache": cache}
    if return_token_nll:
        res["token_nll"] = torch.tensor(token_nll, dtype=torch.float64)
    return res


@torch.no_grad()
def fast_logits(model, ids: torch.Tensor, context_len: int, spec: FakeQuantSpec | None, cache=None) -> torch.Tensor:
    """``[B, n - context_len, V]`` logits (model dtype) predicting ``ids[:, context_len:]``, one teacher-forced forward
    through ``spec`` (``None``: the plain model); positions before ``context_len`` are the exact prompt. A ``cache``
    (plain model only) is filled with all ``n`` tokens, e.g. to generate after the scored text."""
    if cache is not None and spec is not None:
        raise ValueError("a cache records the plain model's keys and values: pass spec=None with a cache")
    use = dict(cache_kwargs(model, cache), use_cache=True) if cache is not None else dict(use_cache=False)
    with fake_quant(model, spec, prefill_len=context_len):
        return model(ids, **use, logits_to_keep=ids.shape[1] - context_len + 1).logits[:, :-1]


@torch.no_grad()
def fast_nll(model, input_ids: torch.Tensor, context_len: int, spec: FakeQuantSpec | None,
             return_token_nll: bool = False, chunk: int = 512, cache=None) -> dict:
    """:func:`cache_nll`'s numbers in one teacher-forced forward (``spec=None``: the plain model).

    ``input_ids`` ``[B, n]`` (B windows, no padding); tokens ``[context_len, n)`` of each row are scored;
    positions before ``context_len`` are the exact prompt. ``cache`` (with ``spec=None``): filled with the ``n``
    tokens (:func:`fast_logits`).
    """
    if input_ids.dim() != 2:
        raise ValueError("input_ids must be [B, n]")
    ids, n = _scored_ids(model, input_ids, context_len)
    logits = fast_logits(model, ids, context_len, spec, cache)
    tgt = ids[:, context_len:]
    parts = []
    for a in range(0, tgt.shape[1], chunk):
        lg = logits[:, a : a + chunk].float()
        parts.append(F.cross_entropy(lg.transpose(1, 2), tgt[:, a : a + chunk], reduction="none").double())
    token_nll = torch.cat(parts, dim=1).cpu()  # [B, n - context_len]
    nll = token_nll.mean().item()
    res = {"nll": nll, "ppl": math.exp(nll), "tokens": token_nll.numel()}
    if return_token_nll:
        res["token_nll"] = token_nll[0] if token_nll.shape[0] == 1 else token_nll
    return res


def evaluation_ids(tokenizer, n_tokens: int, text: str | None = None) -> torch.Tensor:
    """The first ``n_tokens`` token ids (no special tokens) of the held-out half of the WikiText file."""
    from oscar_hf.data import split_texts, tokenize
    from oscar_hf.eval.models import wikitext_path

    if text is None:
        text = wikitext_path().read_text(encoding="utf-8")
    split = split_texts(text)
    start = max(split.boundary + 1, int(len(text) * EVAL_START_FRACTION))
    start = text.find("\n", start) + 1 or start  # begin at a line
    ids = tokenize(tokenizer, text[start:], n_tokens)
    if len(ids) < n_tokens:
        raise ValueError(f"held-out text has only {len(ids)} tokens, {n_tokens} requested")
    return ids


def perplexity(
    model,
    text_or_ids,
    method,
    context_len: int = 2048,
    n_windows: int = 4,
    prefill_len: int = 1,
    tokenizer=None,
    exact: bool = False,
    progress: bool = True,
) -> dict:
    """Perplexity of ``method`` over ``n_windows`` consecutive, non-overlapping windows of ``context_len`` tokens.

    ``text_or_ids``: a string (tokenized with ``tokenizer``; give held-out text, e.g. from
    :func:`evaluation_ids`), or a 1-D / ``[1, N]`` id tensor. ``method``: a
    :class:`~oscar_hf.eval.methods.KVMethod` or a registered name. In each window the first
    ``prefill_len`` tokens are the (exact) prompt, every later token is predicted by a decode step of
    the method's cache (fast fake-quant path unless ``exact`` or the method has none).
    Returns ``ppl``, ``nll``, ``tokens``, per-window ``window_ppl``, ``bits`` (at ``context_len``) and
    ``mean_bits`` (averaged over the scored positions).
    """
    from .methods import KVMethod, get_method

    if isinstance(method, str):
        method = get_method(method)
    if not isinstance(method, KVMethod):
        raise TypeError(f"method must be a KVMethod or a name, got {type(method).__name__}")
    if isinstance(text_or_ids, str):
        if tokenizer is None:
            raise ValueError("a text needs its tokenizer")
        from oscar_hf.data import tokenize

        ids = tokenize(tokenizer, text_or_ids, context_len * n_windows)
    else:
        ids = torch.as_tensor(text_or_ids).reshape(-1)
    need = context_len * n_windows
    if ids.numel() < need:
        raise ValueError(f"{n_windows} windows of {context_len} tokens need {need} tokens, got {ids.numel()}")
    windows = ids[:need].view(n_windows, context_len)
    use_fast = method.fast and not exact
    spec = method.fake_spec(model) if use_fast else None
    nlls = []
    desc = f"ppl {method.name}"
    for w in tqdm(range(n_windows), desc=desc, disable=_bar_disabled(progress) or n_windows == 1, leave=False):
        x = windows[w : w + 1]
        if use_fast:
            r = fast_nll(model, x, prefill_len, spec, return_token_nll=True)
        else:
            r = cache_nll(model, x, prefill_len, lambda: method.make_cache(model), progress=progress,
                          desc=f"{desc} [{w + 1}/{n_windows}]", return_token_nll=True)
        nlls.append(r["token_nll"].reshape(-1))
    all_nll = torch.cat(nlls)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    scored = range(prefill_len + 1, context_len + 1)  # cache length seen by each scored token's step
    return {
        "method": method.name,
        "ppl": math.exp(all_nll.mean().item()),
        "nll": all_nll.mean().item(),
        "tokens": all_nll.numel(),
        "window_ppl": [math.exp(t.mean().item()) for t in nlls],
        "bits": method.bits(context_len, head_dim, prefill_len),
        "mean_bits": sum(method.bits(t, head_dim, prefill_len) for t in scored) / len(scored),
        "path": "fast" if use_fast else "token-by-token",
        "settings": method.settings(),
        "context_len": context_len,
        "prefill_len": prefill_len,
        "n_windows": n_windows,
    }
