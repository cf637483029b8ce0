"""The registered attention function ``oscar_<base>``: a call whose ``key`` is an :class:`OscarKV` (what an OSCAR
layer's ``update`` returns) is served by that layer's own read; any other call goes to the user's implementation.
"""
from __future__ import annotations

import torch

from .patching import register_handler, restore_attention, switch_attention

PREFIX = "oscar_"


class OscarKV:
    """What an OSCAR layer's ``update`` returns to the attention function: the layer and the new rows
    ``key_states`` / ``value_states [B, Hk, L, D]``."""

    __slots__ = ("layer", "key_states", "value_states")

    def __init__(self, layer, key_states: torch.Tensor, value_states: torch.Tensor):
        self.layer, self.key_states, self.value_states = layer, key_states, value_states

    @property
    def shape(self):  # what a Transformers cache would have returned: [B, Hk, kv, D], kv from the layer's mask size
        b, h, l, d = self.key_states.shape
        return torch.Size((b, h, self.layer.get_mask_sizes(l)[0], d))

    dtype = property(lambda self: self.key_states.dtype)
    device = property(lambda self: self.key_states.device)

    def attend(self, query: torch.Tensor, attention_mask, scaling: float, module, base: str, **kwargs) -> torch.Tensor:
        """``[B, L, Hq, D]``: attention of ``query [B, Hq, L, D]`` over the layer's cache plus the new rows,
        which the layer then stores."""
        return self.layer.attend(self, query, attention_mask, scaling, module, base, **kwargs)


def _handler(module, query, key, value, attention_mask, *args, base: str, dropout: float = 0.0, scaling=None,
             sliding_window=None, softcap=None, **kwargs):
    if not isinstance(key, OscarKV):
        return NotImplemented
    # soft-capping and learned sinks (s_aux [Hq]) stay in kwargs: the layer's read applies them (cache.base.logit_terms)
    if softcap:
        kwargs["softcap"] = softcap
    if kwargs.get("sinks") is not None or kwargs.get("position_bias") is not None:
        raise NotImplementedError("OSCAR attention does not implement per-token attention sinks (`sinks`) or "
                                  "position_bias (learned per-head sinks, `s_aux`, are supported)")
    if dropout and module.training:
        raise NotImplementedError("OSCAR attention is for inference; attention dropout in training mode is not supported")
    if args:
        raise TypeError(f"unexpected positional arguments to the attention function: {len(args)}")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    kwargs.pop("is_causal", None)
    return key.attend(query, attention_mask, scaling, module, base, dropout=dropout, **kwargs), None


register_handler(PREFIX, _handler)


def enable_oscar(model) -> str:
    """Route ``model``'s (or its config's) attention through OSCAR; other caches keep the user's implementation."""
    return switch_attention(model, PREFIX)


def disable_oscar(model) -> str:
    """Restore the user's attention implementation."""
    return restore_attention(model)
