"""Hybrid decoder layers (attention + an SSM state in one layer: Falcon-H1, Zamba): an OSCAR layer with Transformers'
own state beside it."""
from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from .compiled import CompiledOscarLayer
from .dynamic import OscarLayer


class _HybridState:
    """As Transformers' ``LinearAttentionAndFullAttentionLayer``: the state is a ``LinearAttentionLayer`` (after the
    attention in the MRO: the attention's length, offload and the like win), the attention an OSCAR layer
    (``_attention``); the operations on both call both. ``lazy_initialization`` gets keys and values positionally
    from the attention, keywords from the state."""

    _attention: type = OscarLayer
    supports_early_init = False  # (the state's)
    # the state's too: on Transformers 5.17 a property, False once the layer holds recurrent states (which crop cannot
    # roll back); the OSCAR layer's True would let assisted decoding crop them
    is_croppable = LinearAttentionLayer.is_croppable
    __repr__ = LinearAttentionLayer.__repr__

    def __init__(self, *args, number_of_states: int = 1, **kwargs):  # the attention layer's arguments, and the state's
        self._attention.__init__(self, *args, **kwargs)
        LinearAttentionLayer.__init__(self, number_of_states=number_of_states)

    def lazy_initialization(self, *args, **kwargs) -> None:
        if len(args) == 2 and not kwargs:
            self._attention.lazy_initialization(self, *args)
        else:
            LinearAttentionLayer.lazy_initialization(self, *args, **kwargs)

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        self._attention.reset(self)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        LinearAttentionLayer.reorder_cache(self, beam_idx)
        self._attention.reorder_cache(self, beam_idx)

    def crop(self, tokens_to_remove: int) -> None:  # the state first: it refuses unless its past is recorded
        LinearAttentionLayer.crop(self, tokens_to_remove)
        self._attention.crop(self, tokens_to_remove)


class OscarHybridLayer(_HybridState, OscarLayer, LinearAttentionLayer):
    """:class:`OscarLayer` + Transformers' ``LinearAttentionLayer`` state (eager storage)."""

    is_compileable = False


class CompiledOscarHybridLayer(_HybridState, CompiledOscarLayer, LinearAttentionLayer):
    """:class:`CompiledOscarLayer` + Transformers' ``LinearAttentionLayer`` (compileable while it records no past)."""

    _attention = CompiledOscarLayer
    is_compileable = LinearAttentionLayer.is_compileable
