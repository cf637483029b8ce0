"""Perplexity with true cache semantics: every scored token sees exactly what it would see while
decoding with the cache (sink and recent in full precision, the rest from INT2 history).

:func:`cache_nll` prefills ``context`` tokens through the cache, then feeds the scored tokens one
at a time (teacher forcing), so each prediction is made by a decode step of the cache under test.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging


@torch.no_grad()
def cache_nll(
    model,
    input_ids: torch.Tensor,
    context_len: int,
    make_cache: Callable[[], object],
    progress: bool = True,
    desc: str = "scoring",
) -> dict[str, float]:
    """Mean NLL / perplexity of ``input_ids[:, context_len:]`` given the prefix, one decode step per token.

    ``input_ids`` is ``[1, n]``; ``make_cache()`` returns a fresh cache (``DynamicCache``, ``OscarCache``, ...).
    """
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError("cache_nll scores one sequence: input_ids must be [1, n]")
    n = input_ids.shape[1]
    if not 0 < context_len < n:
        raise ValueError(f"context_len={context_len} must lie in (0, {n})")
    dev = next(model.parameters()).device
    ids = input_ids.to(dev)
    cache = make_cache()
    out = model(ids[:, :context_len], past_key_values=cache, use_cache=True)
    logits = out.logits[:, -1].float()
    total = 0.0
    disable = not progress or not hf_logging.is_progress_bar_enabled()
    for t in tqdm(range(context_len, n), desc=desc, disable=disable, leave=False):
        total += torch.nn.functional.cross_entropy(logits, ids[:, t]).item()
        if t + 1 < n:
            logits = model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1].float()
    nll = total / (n - context_len)
    return {"nll": nll, "ppl": math.exp(nll), "tokens": n - context_len, "cache": cache}
