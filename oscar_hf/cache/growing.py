"""`GrowingLayer`: a full-precision layer of the compiled storage, growing in the OSCAR layers' capacity buckets."""
from __future__ import annotations

import torch
from torch.compiler import is_compiling
from transformers.cache_utils import CacheLayerMixin

from .base import BatchOps
from .compiled import HostLength, _fixed_address
from .compiled_eager import regrown


class GrowingLayer(HostLength, BatchOps, CacheLayerMixin):
    """The compiled storage's ``DynamicLayer`` (skipped layers, MLA latents, KV sharing's store layers), so that
    such a model compiles without a ``max_cache_len``. ``keys [B, H, C, Dk]``, ``values [B, H, C, Dv]``, slot =
    position. A decode step gets all ``C`` slots (the ``(C, 0)`` mask hides the unwritten), a multi-token forward
    the ``T`` written ones."""

    is_compileable = True
    is_croppable = True
    is_sliding = False
    supports_early_init = False
    _BATCH_DIMS = (("keys", 0), ("values", 0))

    def __init__(self, max_cache_len: int | None = None, **kwargs):
        super().__init__()
        self._init_length(max_cache_len)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = _fixed_address(torch.zeros((), dtype=torch.long, device=self.device))
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self._allocate(self._first_capacity(key_states.shape[2]))
        self.is_initialized = True

    def _allocate(self, capacity: int) -> None:
        # [B, H, C_old, D] -> [B, H, capacity, D], content kept
        self.keys, self.values = (regrown(t, (*t.shape[:2], capacity, t.shape[3]), t.dtype, t.device, dim=2)
                                  for t in (self.keys, self.values))
        self.capacity = capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        l = key_states.shape[2]
        if not is_compiling():
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if key_states.shape[0] != self.keys.shape[0]:
                raise ValueError(f"OscarCache full-precision layer holds batch size {self.keys.shape[0]}, got "
                                 f"{key_states.shape[0]} rows (use batch_repeat_interleave / batch_select_indices)")
            self._count_rows(l)
        idx = self.length + torch.arange(l, device=self.device)  # [L] slots of the new rows
        self.keys.index_copy_(2, idx, key_states)
        self.values.index_copy_(2, idx, value_states)
        self.length.add_(l)
        if is_compiling() or l == 1:  # all C slots: a decode step's shapes stay fixed (its mask hides the unwritten ones)
            return self.keys, self.values
        # a multi-token forward reads the written slots only, as DynamicLayer: the model may skip its mask there
        return self.used()

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        if is_compiling():
            return self.capacity, 0
        return (self.capacity_after(1) if query_length == 1 else self.host_len + query_length), 0

    def reset(self) -> None:
        if self.is_initialized:
            for t in (self.keys, self.values, self.length):
                t.zero_()
        self.host_len, self.announced = 0, False

    def crop(self, tokens_to_remove: int) -> None:
        """Exact: the slots above the new length are hidden by the mask and overwritten by the next writes."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove (transformers 5.x)")
        self.host_len = max(0, self.host_len + tokens_to_remove)
        if self.is_initialized:
            self.length.fill_(self.host_len)

    def used(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of the slots written, ``[B, H, T, D]`` views."""
        return self.keys[:, :, : self.host_len], self.values[:, :, : self.host_len]
