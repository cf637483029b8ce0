"""Hybrid decoder layers (attention + an SSM state in one layer: Falcon-H1, Zamba): an OSCAR layer with Transformers'
own state beside it."""
from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from .layer import OscarLayer


class OscarHybridLayer(OscarLayer, LinearAttentionLayer):
    """:class:`OscarLayer` + Transformers' ``LinearAttentionLayer`` state, as Transformers'
    ``LinearAttentionAndFullAttentionLayer``: the state after the attention in the MRO (the attention's length,
    offload and the like win); the operations on both call both. ``lazy_initialization`` gets keys and values
    positionally from the attention, keywords from the state. Compileable while the state records no past."""

    is_compileable = LinearAttentionLayer.is_compileable
    supports_early_init = False  # (the state's)
    # the state's too: on Transformers 5.17 a property, False once the layer holds recurrent states (which crop cannot
    # roll back); the OSCAR layer's True would let assisted decoding crop them
    is_croppable = LinearAttentionLayer.is_croppable
    __repr__ = LinearAttentionLayer.__repr__

    def __init__(self, *args, number_of_states: int = 1, **kwargs):  # the attention layer's arguments, and the state's
        OscarLayer.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:
            OscarLayer.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        OscarLayer.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        OscarLayer.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:  # the state first: it refuses unless its past is recorded
        LinearAttentionLayer.crop(self, tokens_to_remove)
        OscarLayer.crop(self, tokens_to_remove)
