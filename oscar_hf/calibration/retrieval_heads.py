"""Retrieval heads: the KV heads that copy a fact from far back (Wu et al., 2024), which a 2-bit history can lose.
Probes ``<haystack> <fact> <haystack> <question> <answer>`` in *calibration* text score each KV head by the attention
mass the answer-predicting rows put on the fact (max over its query heads). docs/quality.md, "Retrieval-safe defaults".
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..data import tokenize
from ..rotations import ranked_heads
from .hooks import recording

FACT = "The access code of {name} is {value}."
ASK = " What is the access code of {name}? The access code of {name} is"
PROBES = 12  # default probe count (calibrate(), scripts/calibrate.py, scripts/find_retrieval_heads.py)
LENGTHS = (2048, 4096)  # default probe lengths in tokens (cut to the model's context)
NAMES = ("Miriam Okafor", "Tomas Lindqvist", "Priya Raman", "Hugo Moreau", "Aiko Tanaka", "Pavel Novak",
         "Lucia Ferreira", "Samuel Adeyemi")


@dataclass
class Probe:
    ids: torch.Tensor  # [n] context + question + answer
    fact: tuple[int, int]  # [start, end) of the fact sentence
    answer: tuple[int, int]  # [start, end) of the answer tokens (the rows predicting them start one earlier)


def probe_needles(tokenizer, haystack_ids: torch.Tensor, n: int = 12, lengths=(2048, 4096),
                  depths=(0.25, 0.5, 0.75), seed: int = 1000) -> list[Probe]:
    """``n`` probes cycling over ``lengths x depths``; ``haystack_ids`` should be calibration text."""
    rng = random.Random(seed)
    enc = lambda s: torch.tensor(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    cells = [(L, d) for L in lengths for d in depths]
    out = []
    hay = haystack_ids.reshape(-1)
    for i in range(n):
        L, d = cells[i % len(cells)]
        name, value = rng.choice(NAMES), str(rng.randint(1_000_000, 9_999_999))
        fact = enc(" " + FACT.format(name=name, value=value) + " ")
        ask, ans = enc(ASK.format(name=name)), enc(" " + value)
        n_hay = L - len(fact) - len(ask) - len(ans)
        if n_hay < 1 or hay.numel() < n_hay + i:
            raise ValueError(f"haystack too short for a probe of length {L}")
        h = hay[i : i + n_hay]  # shift the haystack per probe
        at = int(round(d * n_hay))
        ids = torch.cat([h[:at], fact, h[at:], ask, ans])
        out.append(Probe(ids, (at, at + len(fact)), (len(ids) - len(ans), len(ids))))
    return out


def _fact_mass(module, query, key, value, attention_mask, *args, base: str, probe: Probe, mass: torch.Tensor,
               scaling=None, **kwargs):
    """Add the answer-predicting rows' attention mass on ``probe``'s fact span to ``mass [num_layers, Hq]``; the base
    attention then runs (``NotImplemented``)."""
    if not isinstance(key, torch.Tensor):
        return NotImplemented
    (f0, f1), (a0, a1) = probe.fact, probe.answer
    rows = torch.arange(a0 - 1, a1 - 1, device=query.device)  # the positions whose next token is an answer token
    q = query[:, :, rows].float()  # [B, Hq, m, D]
    hq, hk = q.shape[1], key.shape[1]
    k = key.float().repeat_interleave(hq // hk, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * (scaling or q.shape[-1] ** -0.5)  # [B, Hq, m, kv]
    s = s.masked_fill(torch.arange(k.shape[2], device=q.device)[None, :] > rows[:, None], float("-inf"))
    mass[module.layer_idx] += F.softmax(s, -1)[..., f0:f1].sum(-1).mean((0, 2)).cpu()  # [Hq]
    return NotImplemented


@torch.no_grad()
def retrieval_scores(model, probes: list[Probe], progress: bool = True) -> torch.Tensor:
    """``[num_layers, num_kv_heads]``: mean over probes of the max over each KV head's query heads of the attention
    mass on the fact; layers without attention stay zero."""
    from tqdm.auto import tqdm
    cfg = model.config.get_text_config(decoder=True)
    nl, hq = cfg.num_hidden_layers, cfg.num_attention_heads
    hk = getattr(cfg, "num_key_value_heads", None) or hq
    mass = torch.zeros(nl, hq)
    dev = next(model.parameters()).device
    for pr in tqdm(probes, desc="retrieval probes", disable=not progress):
        with recording(model, functools.partial(_fact_mass, probe=pr, mass=mass)):
            model(pr.ids[None].to(dev), use_cache=False, logits_to_keep=1)
    return (mass / len(probes)).reshape(nl, hk, hq // hk).amax(-1)


def top_heads(scores: torch.Tensor, k: int) -> tuple[tuple[int, int], ...]:
    """The ``k`` highest-scoring ``(layer, kv_head)`` pairs, best first."""
    return tuple(ranked_heads(scores, range(scores.shape[0]))[:k])


def probe_lengths(model, lengths=LENGTHS) -> tuple[int, ...]:
    """``lengths`` that fit the model's context (``max_position_embeddings``); the context itself if none does."""
    if not lengths or any(int(L) < 2 for L in lengths):
        raise ValueError(f"retrieval probe lengths must be integers >= 2, got {lengths!r}")
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or max(lengths)
    return tuple(int(L) for L in lengths if L <= limit) or (min(limit, min(lengths)),)


def find_retrieval_heads(model, tokenizer, calibration_text: str, n_probes: int = PROBES, lengths=LENGTHS,
                         seed: int = 1000, progress: bool = True, bf16_autocast: bool = True) -> torch.Tensor:
    """``[num_layers, Hk]`` float32 retrieval scores from ``n_probes`` probes in calibration text (for
    ``OscarRotations.retrieval_scores``). ``bf16_autocast``: a float32 model runs the probes under bfloat16 autocast,
    2x faster; the scores move by ~0.01, far less than the gap the threshold sits in."""
    if n_probes < 1:
        raise ValueError(f"n_probes must be >= 1, got {n_probes}")
    lengths = probe_lengths(model, lengths)
    need = max(lengths) + n_probes  # each probe reads the haystack one token further on
    hay = tokenize(tokenizer, calibration_text, need)
    if hay.numel() < need:
        raise ValueError(f"retrieval probes of {max(lengths)} tokens need {need} tokens of calibration text, got "
                         f"{hay.numel()}: give more text, shorter retrieval lengths, or retrieval_probes=0")
    probes = probe_needles(tokenizer, hay, n=n_probes, lengths=lengths, seed=seed)
    p = next(model.parameters())
    cast = bf16_autocast and p.dtype == torch.float32 and p.device.type in ("cpu", "cuda")
    with torch.autocast(p.device.type, dtype=torch.bfloat16, enabled=cast):
        return retrieval_scores(model, probes, progress=progress).float()
