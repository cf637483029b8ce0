"""Helpers shared by the generate tests (imported as a plain module: pytest puts tests/ on sys.path)."""
import torch


def left_pad(prompts):
    """``(ids, attention_mask)`` ``[B, T]``: the 1-D ``prompts`` right-aligned, left padding 0 (masked)."""
    t = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), t, dtype=torch.long)
    am = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, t - len(p) :], am[i, t - len(p) :] = p, 1
    return ids, am
