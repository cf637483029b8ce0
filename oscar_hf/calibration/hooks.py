"""The calibration hooks: a recorder is an attention handler (prefix ``oscarcalib_``) that runs the user's attention
unchanged and records ``query [B, Hq, q, D]``, ``key`` / ``value [B, Hk, kv, D]`` and the output ``[B, q, Hq, D]``,
padded tokens excluded; and the model's run over calibration windows (docs/calibration.md, "The hooks")."""
from __future__ import annotations

import contextlib
import inspect

import torch
from torch.nn.utils.rnn import pad_sequence

from ..patching import patched, register_handler

PREFIX = "oscarcalib_"

_ACTIVE: list = []


def _dispatch(*args, **kwargs):  # the innermost recording's recorder; outside one, the user's attention
    return _ACTIVE[-1](*args, **kwargs) if _ACTIVE else NotImplemented

register_handler(PREFIX, _dispatch)


@contextlib.contextmanager
def recording(model, recorder):
    """Route ``model``'s attention through ``recorder`` (eval mode, no grad), restored afterwards."""
    was_training = model.training
    _ACTIVE.append(recorder)
    try:
        model.eval()
        with patched(model, PREFIX), torch.no_grad():
            yield recorder
    finally:
        _ACTIVE.remove(recorder)
        model.train(was_training)


def _allowed_4d(mask: torch.Tensor) -> torch.Tensor:  # additive: 0 = attend, large negative / -inf = masked
    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def token_validity(attention_mask, batch: int, q_len: int, kv_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid_q [B, q], valid_kv [B, kv])`` booleans: which positions are real tokens."""
    if attention_mask is None:
        vk = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    elif not isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(
            f"calibration cannot read an attention mask of type {type(attention_mask).__name__}; "
            "load the model with attn_implementation='sdpa' or 'eager'")
    elif attention_mask.dim() == 2:
        vk = attention_mask[:, -kv_len:].bool()
    elif attention_mask.dim() == 4:
        vk = _allowed_4d(attention_mask[..., :kv_len]).any(dim=1).any(dim=1)
    else:
        raise NotImplementedError(f"unexpected attention mask shape {tuple(attention_mask.shape)}")
    vk = vk.to(device).expand(batch, kv_len)
    if q_len > kv_len:
        raise NotImplementedError(f"query length {q_len} exceeds key length {kv_len}")
    return vk[:, kv_len - q_len :], vk


def allowed_matrix(attention_mask, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Bool ``[B, 1 | H, q, kv]``: which key each query may attend to (causal when the mask is None)."""
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    if attention_mask is None:
        return causal.expand(batch, 1, q_len, kv_len)
    if attention_mask.dim() == 2:
        return causal[None, None] & attention_mask[:, None, None, -kv_len:].bool().to(device)
    return _allowed_4d(attention_mask[..., :kv_len]).to(device).expand(batch, -1, q_len, kv_len)


def run_windows(model, recorder, seqs: list[torch.Tensor], batch_size: int, pad_id: int, bar, passes: int = 1) -> None:
    """Every 1-D sequence of ``seqs`` through ``model`` under ``recorder``, ``batch_size`` at a time (right-padded,
    one ``bar`` step a batch), ``passes`` times (``recorder.start_score_weighted()`` before the second)."""
    p = next(model.parameters(), None)
    dev = p.device if p is not None else torch.device("cpu")
    keep_one = "logits_to_keep" in inspect.signature(model.forward).parameters
    with recording(model, recorder):
        for n in range(passes):
            if n == 1:
                recorder.start_score_weighted()
            for s in range(0, len(seqs), batch_size):
                chunk = seqs[s : s + batch_size]
                kw = dict(use_cache=False, logits_to_keep=1) if keep_one else dict(use_cache=False)  # (LM head: waste)
                lengths = torch.tensor([x.numel() for x in chunk])
                kw["input_ids"] = pad_sequence(chunk, batch_first=True, padding_value=pad_id).to(dev)  # right-padded
                if bool((lengths < lengths.max()).any()):  # [n, L] 1 on real tokens
                    kw["attention_mask"] = (torch.arange(int(lengths.max()))[None] < lengths[:, None]).long().to(dev)
                model(**kw)
                bar.update(1)


def as_sequences(input_ids) -> list[torch.Tensor]:
    if isinstance(input_ids, torch.Tensor):
        input_ids = input_ids[None] if input_ids.dim() == 1 else input_ids
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [n, seq_len], got shape {tuple(input_ids.shape)}")
        seqs = [r for r in input_ids.long()]
    else:
        seqs = [torch.as_tensor(x, dtype=torch.long).reshape(-1) for x in input_ids]
    seqs = [s for s in seqs if s.numel() > 0]
    if not seqs:
        raise ValueError("no calibration tokens given")
    return seqs


def progress_bar(progress: bool, total: int, desc: str, shared=None):
    """A tqdm of ``total`` steps, off when ``progress`` is False or Transformers' progress bars are (its ``tqdm``);
    ``shared``: a caller's bar instead, which leaving ``with`` does not close."""
    from transformers.utils import logging as hf_logging
    return contextlib.nullcontext(shared) if shared is not None else hf_logging.tqdm(
        total=total, desc=desc, disable=not progress)
