"""`GrowingLayer`: a full-precision layer of the compiled storage, growing in the OSCAR layers' capacity buckets."""
from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from .compiled import _compiling, _fixed_address, capacity_for


class GrowingLayer(CacheLayerMixin):
    """The compiled storage's ``DynamicLayer`` (skipped layers, MLA latents, KV sharing's store layers), so that
    such a model compiles without a ``max_cache_len``. ``keys [B, H, C, Dk]``, ``values [B, H, C, Dv]``, slot =
    position. A decode step gets all ``C`` slots (the ``(C, 0)`` mask hides the unwritten), a multi-token forward
    the ``T`` written ones."""

    is_compileable = True
    is_croppable = True
    is_sliding = False
    supports_early_init = False

    def __init__(self, max_cache_len: int | None = None, **kwargs):
        super().__init__()
        self.fixed_capacity = max_cache_len  # StaticOscarCache's: no growth
        self.length = torch.zeros((), dtype=torch.long)
        self.host_len = self.capacity = 0
        self.expected_len = 0  # the length generate will reach (set by the compiled step's hook; 0: unknown)
        self.announced = False  # the compiled step's wrapper already counted this forward's token

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = _fixed_address(torch.zeros((), dtype=torch.long, device=self.device))
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self._allocate(self.fixed_capacity or capacity_for(max(self.host_len, key_states.shape[2]), 0, self.expected_len))
        self.is_initialized = True

    def _allocate(self, capacity: int) -> None:
        def grow(old):  # [B, H, C_old, D] -> [B, H, capacity, D], content kept
            new = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
            new[:, :, : old.shape[2]] = old[:, :, :capacity]
            return _fixed_address(new)

        self.keys, self.values = grow(self.keys), grow(self.values)
        self.capacity = capacity

    def capacity_after(self, n: int) -> int:
        """The capacity once ``n`` more tokens are written (:meth:`advance`'s rule): the mask is built before."""
        need = self.host_len + n
        if self.fixed_capacity:
            return self.fixed_capacity
        if not self.is_initialized:
            return capacity_for(need, 0, self.expected_len)
        return self.capacity if need <= self.capacity else capacity_for(need, self.capacity if n == 1 else 0,
                                                                         self.expected_len)

    def advance(self, n: int) -> None:
        """Host side, before ``n`` new tokens are written: a bigger bucket when they would not fit."""
        if self.is_initialized and self.host_len + n > self.capacity:
            if self.fixed_capacity:
                raise ValueError(f"StaticOscarCache is full (max_cache_len={self.fixed_capacity}, "
                                 f"{self.host_len + n} tokens)")
            self._allocate(self.capacity_after(n))
        self.host_len += n

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        l = key_states.shape[2]
        if not _compiling():
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if key_states.shape[0] != self.keys.shape[0]:
                raise ValueError(f"OscarCache full-precision layer holds batch size {self.keys.shape[0]}, got "
                                 f"{key_states.shape[0]} rows (use batch_repeat_interleave / batch_select_indices)")
            if self.announced:
                self.announced = False
            else:
                self.advance(l)
        idx = self.length + torch.arange(l, device=self.device)  # [L] slots of the new rows
        self.keys.index_copy_(2, idx, key_states)
        self.values.index_copy_(2, idx, value_states)
        self.length.add_(l)
        if _compiling() or l == 1:  # all C slots: a decode step's shapes stay fixed (its mask hides the unwritten ones)
            return self.keys, self.values
        # a multi-token forward reads the written slots only, as DynamicLayer: the model may skip its mask there
        return self.used()

    def get_seq_length(self):
        return self.length if _compiling() else self.host_len

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        if _compiling():
            return self.capacity, 0
        return (self.capacity_after(1) if query_length == 1 else self.host_len + query_length), 0

    def get_max_length(self) -> int:
        return self.fixed_capacity or -1

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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.is_initialized:  # in place: the compiled step keeps the addresses
            for t in (self.keys, self.values):
                t.copy_(t.index_select(0, beam_idx.to(t.device)))

    def _rebatch(self, fn) -> None:
        if self.fixed_capacity:
            raise NotImplementedError("StaticOscarCache has a fixed batch size")
        if self.is_initialized:
            self.keys, self.values = (_fixed_address(fn(t).contiguous()) for t in (self.keys, self.values))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._rebatch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._rebatch(lambda t: t[indices])

    def used(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of the slots written, ``[B, H, T, D]`` views."""
        return self.keys[:, :, : self.host_len], self.values[:, :, : self.host_len]
