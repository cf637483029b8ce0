"""`StepShared`: what the compiled layers of one decode forward compute once and read alike."""
from __future__ import annotations

import torch

from .layer_eager import _fixed_address


class StepShared:
    """What every compiled layer of one decode forward reads alike, computed once by the first of them (fewer nodes
    in the step graph): the length ``t`` (0-d, one per device: :meth:`join`), left padding ``pad [B]``, the window
    mask ``[B, 1, 1, S0 + R]``, the history length (0-d). The last layer clears it, so that every trace starts from
    the same state and dynamo's guards hold."""

    def __init__(self, last_layer: int | None = None):
        self.last_layer = last_layer  # index of the last layer that shares it (None: every layer clears it)
        self.lengths = {}  # device -> (its layers' length tensor, the layer that advances it)
        self.config = None  # the decode op's StepConfig (the same for every layer)
        self.clear()

    def clear(self) -> None:
        self.layer_idx, self.key, self.t, self.pad, self.win_mask, self.hist_len = -1, None, None, None, None, None

    def join(self, layer: "OscarLayer") -> torch.Tensor:
        """The length tensor of ``layer``'s device; its highest-index layer advances it."""
        length, last = self.lengths.get(layer.device, (None, None))
        if length is None:
            length = _fixed_address(torch.zeros((), dtype=torch.long, device=layer.device))
        if last is None or layer.layer_idx >= last.layer_idx:
            if last is not None:
                last.advances_length = False
            last = layer
        layer.advances_length = last is layer
        self.lengths[layer.device] = (length, last)
        return length
