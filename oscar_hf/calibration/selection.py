"""End-to-end check of a calibration's candidates: next-token KL through the real cache on held-out tokens (why the
held-out attention error is not enough, and how it is measured: docs/calibration.md, "The end-to-end check")."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..config import OscarConfig
from ..rotations import OscarRotations

SCORED_TOKENS = 512  # tokens of the held-out window scored after its prompt
CONFIDENT = 0.9  # the model's top-token probability from which a recall copy's flip counts as a failed copy


@torch.no_grad()
def reference_log_probs(model, ids: torch.Tensor, scored: int = SCORED_TOKENS) -> torch.Tensor:
    """``[1, scored, vocab]`` float32 log-probabilities, no cache, at the last ``scored`` positions of ``ids [n]``."""
    ids = ids.reshape(1, -1).to(next(model.parameters()).device)
    return torch.log_softmax(model(ids, use_cache=False, logits_to_keep=scored).logits.float(), -1)


@torch.no_grad()
def cached_log_probs(model, rotations: OscarRotations, ids: torch.Tensor, config: OscarConfig,
                     scored: int = SCORED_TOKENS) -> torch.Tensor:
    """``[1, scored, vocab]`` float32 log-probabilities at the last ``scored`` positions of ``ids [n]`` through an
    ``OscarCache`` of ``config``: the rest prefilled (longer than ``sink + recent``), then the scored tokens in one
    forward."""
    from ..cache import OscarCache
    from ..compat import cache_kwargs
    ids = ids.reshape(1, -1).to(next(model.parameters()).device)
    prompt = ids.shape[1] - scored
    if prompt <= config.sink + config.recent:
        raise ValueError(f"a held-out window of {ids.shape[1]} tokens leaves a prompt of {prompt} tokens: it must be "
                         f"longer than sink + recent = {config.sink + config.recent}")
    cache = OscarCache(model, rotations, config)
    model(ids[:, :prompt], **cache_kwargs(model, cache), logits_to_keep=1)
    return torch.log_softmax(model(ids[:, prompt:], **cache_kwargs(model, cache)).logits.float(), -1)


@torch.no_grad()
def next_token_kl(model, rotations: OscarRotations, ids: torch.Tensor, *, sink: int = 64, recent: int = 256,
                  group_size: int = 64, meta_dtype: str = "bfloat16", scored: int = SCORED_TOKENS,
                  reference: torch.Tensor | None = None, config: OscarConfig | None = None) -> float:
    """Mean KL(model || model with the cache) over the last ``scored`` tokens of ``ids [n]``, the rest the prompt
    (longer than ``sink + recent``). ``reference``: :func:`reference_log_probs` of ``ids``. ``config``: the whole
    cache config, in place of ``sink`` / ``recent`` / ``group_size`` / ``meta_dtype`` without heads."""
    config = OscarConfig(sink=sink, recent=recent, group_size=group_size, meta_dtype=meta_dtype,
                         retrieval_heads=0) if config is None else config
    got = cached_log_probs(model, rotations, ids, config, scored)
    ref = reference if reference is not None else reference_log_probs(model, ids, scored)
    return _mean_kl(ref, got)


class Recall(NamedTuple):
    """:func:`greedy_mismatch`'s measures of a recall copy."""

    mismatch: float  # share of positions whose most likely next token through the cache is not the model's
    kl: float  # mean KL(model || cache) there
    confident: float  # the mismatch among the positions where the model's top token has probability >= CONFIDENT


@torch.no_grad()
def greedy_mismatch(model, rotations: OscarRotations, ids: torch.Tensor, config: OscarConfig, scored: int,
                    reference: torch.Tensor | None = None) -> Recall:
    """:class:`Recall` over the last ``scored`` positions of ``ids [n]``: the share where the cache's most likely
    next token is not the model's (``reference``: :func:`reference_log_probs`), where greedy decoding through the
    cache would part from the model's; the mean KL there and the share among the model's confident positions
    (diagnostics beside it: a flip where the model is sure is a failed copy, not a near tie)."""
    got = cached_log_probs(model, rotations, ids, config, scored)
    ref = reference if reference is not None else reference_log_probs(model, ids, scored)
    flips = got.argmax(-1) != ref.argmax(-1)
    sure = ref.max(-1).values >= math.log(CONFIDENT)
    confident = float(flips[sure].float().mean()) if sure.any() else 0.0
    return Recall(float(flips.float().mean()), _mean_kl(ref, got), confident)


def _mean_kl(ref: torch.Tensor, got: torch.Tensor) -> float:
    """Mean over positions of KL(ref || got), both ``[..., vocab]`` log-probabilities."""
    return float((ref.exp() * (ref - got)).sum(-1).mean())
