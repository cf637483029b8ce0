"""Hybrid decoder layers (attention + an SSM state in one layer: Falcon-H1, Zamba): an OSCAR layer with Transformers'
own state beside it."""
from __future__ import annotations

from transformers.cache_utils import LinearAttentionLayer

from .compiled import CompiledOscarLayer
from .dynamic import OscarLayer


def _attention_only(name: str):
    """The attention layer's method ``name`` (``LinearAttentionLayer``, first in the MRO, has its own)."""
    return lambda self, *args: getattr(self._attention, name)(self, *args)


def _state_then_attention(name: str):
    """``name`` on the state first (its ``crop`` refuses unless its past is recorded), then on the attention."""
    def both(self, *args) -> None:
        getattr(LinearAttentionLayer, name)(self, *args)
        getattr(self._attention, name)(self, *args)
    return both


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

    reset, reorder_cache, crop = map(_state_then_attention, ("reset", "reorder_cache", "crop"))
    # the attention's tokens (Transformers 5.25's LinearAttentionLayer has its own count)
    offload, prefetch, get_max_length, get_seq_length = map(
        _attention_only, ("offload", "prefetch", "get_max_length", "get_seq_length"))


class OscarHybridLayer(_HybridState, OscarLayer):
    """:class:`OscarLayer` + Transformers' ``LinearAttentionLayer`` state (eager storage)."""

    is_compileable = False


class CompiledOscarHybridLayer(_HybridState, CompiledOscarLayer):
    """:class:`CompiledOscarLayer` + Transformers' ``LinearAttentionLayer`` (compileable while it records no past)."""

    _attention = CompiledOscarLayer
