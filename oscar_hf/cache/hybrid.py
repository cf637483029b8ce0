"""Hybrid decoder layers (attention + an SSM state in one layer: Falcon-H1, Zamba): an OSCAR layer with Transformers'
own state beside it."""
from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

from .compiled import CompiledOscarLayer
from .dynamic import OscarLayer


class _HybridState(LinearAttentionLayer):
    """As Transformers' ``LinearAttentionAndFullAttentionLayer``: the state is its ``LinearAttentionLayer``, the
    attention an OSCAR layer (``_attention``). ``lazy_initialization`` gets keys and values positionally from the
    attention, keywords from the state."""

    _attention: type = OscarLayer

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

    def offload(self):
        return self._attention.offload(self)

    def prefetch(self):
        return self._attention.prefetch(self)

    def get_max_length(self) -> int:
        return self._attention.get_max_length(self)

    def get_seq_length(self):
        # the attention's tokens (Transformers 5.25's LinearAttentionLayer has its own count, first in the MRO)
        return self._attention.get_seq_length(self)


class OscarHybridLayer(_HybridState, OscarLayer):
    """:class:`OscarLayer` + Transformers' ``LinearAttentionLayer`` state (eager storage)."""

    is_compileable = False


class CompiledOscarHybridLayer(_HybridState, CompiledOscarLayer):
    """:class:`CompiledOscarLayer` + Transformers' ``LinearAttentionLayer`` (compileable while it records no past)."""

    _attention = CompiledOscarLayer
