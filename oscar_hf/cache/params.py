"""`LayerParams`: what one quantized layer's write and read need, built once per layer on its device and shared by
every storage. A layer's ``Hk`` KV heads split into ``H2`` INT2 heads (rotations and offsets are theirs) and ``P``
retrieval heads (coded: :mod:`.heads`).
"""
from __future__ import annotations

import dataclasses

import torch

from oscar_hf.kernels.heads_attention import merge_heads
from oscar_hf.kernels.kv import HeadSplit, KVParams
from oscar_hf.kernels.write_path import rotate_quantize

from ..config import OscarConfig
from ..quant import QuantizedRows, encode_heads
from ..rotations import LayerRotation


@dataclasses.dataclass(frozen=True)
class LayerParams:
    r: torch.Tensor  # [2, H2, D, D] float32: key and value rotations (one input of a compiled step)
    mu_k: torch.Tensor | None  # [H2, D] calibrated key offset; None when centering is off or the artifact has none
    mu_v: torch.Tensor | None  # [H2, D]
    clip_k: float
    clip_v: float
    int2_heads: tuple[int, ...]  # the layer's KV heads in the INT2 history, ascending
    coded_heads: tuple[int, ...]  # its retrieval heads, ascending
    int2_idx: torch.Tensor  # [H2] long
    coded_idx: torch.Tensor  # [P] long
    hist_of: torch.Tensor | None  # [Hk] long: KV head -> INT2 head (-1: coded), for the fused write; None without
    coded_of: torch.Tensor | None  # [Hk] long: KV head -> coded head (-1: INT2), for the fused write; None without
    bits: int  # the coded heads' storage (16, 8 or 4)

    @classmethod
    def build(cls, config: OscarConfig, rotation: LayerRotation, layer_idx: int, num_kv_heads: int, coded_heads,
              device) -> "LayerParams":
        coded = tuple(sorted(set(int(h) for h in coded_heads)))
        if coded and not 0 <= coded[0] <= coded[-1] < num_kv_heads:
            raise ValueError(f"layer {layer_idx}: retrieval_heads {coded} out of range for {num_kv_heads} KV heads")
        int2 = tuple(h for h in range(num_kv_heads) if h not in coded)
        r = (rotation.select_heads(int2) if coded else rotation).to(device)
        centered = config.center and (rotation.mu_k is not None or rotation.mu_v is not None)
        idx = lambda hs: torch.tensor(hs, dtype=torch.long, device=device)  # noqa: E731
        def index_of(heads):  # [Hk]: each KV head's place among `heads`, -1 if not there
            return idx([heads.index(h) if h in heads else -1 for h in range(num_kv_heads)])

        return cls(torch.stack([r.r_k, r.r_v]), r.mu_k if centered else None, r.mu_v if centered else None,
                   config.clip_for("k", layer_idx, rotation.clip_k), config.clip_for("v", layer_idx, rotation.clip_v),
                   int2, coded, idx(int2), idx(coded), index_of(int2) if coded else None,
                   index_of(coded) if coded else None, int(config.retrieval_bits))

    r_k = property(lambda self: self.r[0])  # [H2, D, D]
    r_v = property(lambda self: self.r[1])

    def with_tensors(self, fn) -> "LayerParams":
        """The same parameters with ``fn`` applied to each tensor."""
        return dataclasses.replace(self, **{f.name: fn(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), torch.Tensor)})

    def kv(self, config: OscarConfig, mu_k: torch.Tensor | None, mu_v: torch.Tensor | None) -> KVParams:
        """The kernels' :class:`~oscar_hf.kernels.kv.KVParams`, with the offsets the storage reads."""
        heads = None if not self.coded_heads else HeadSplit(self.int2_idx, self.coded_idx, self.coded_of, self.bits)
        return KVParams(self.r_k, mu_k, self.r_v, mu_v, config.group_size, self.clip_k, self.clip_v,
                        config.torch_meta_dtype, config.quantizer, config.block_size, self.hist_of, heads)

    def int2_part(self, x: torch.Tensor) -> torch.Tensor:
        """``x [B, Hk, ...]`` -> its INT2 heads ``[B, H2, ...]`` (``x`` itself when the layer has no coded head)."""
        return x.index_select(1, self.int2_idx) if self.coded_heads else x

    def int2_rows(self, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """Per-KV-head rows ``sinks [Hk, M]`` -> the INT2 heads' ``[H2, M]``."""
        return sinks if sinks is None or not self.coded_heads else sinks.index_select(0, self.int2_idx)

    def coded_rows(self, sinks: torch.Tensor | None) -> torch.Tensor | None:
        """The same for the retrieval heads: ``[P, M]``."""
        return None if sinks is None else sinks.index_select(0, self.coded_idx)

    def encode_coded(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """Window rows ``x [B, Hk, n, D]`` -> the retrieval heads' coded parts ``[B, P, n, *]``, or None."""
        return encode_heads(x.index_select(1, self.coded_idx), self.bits) if self.coded_heads else None

    def encode_history(self, x: torch.Tensor, kind: str, config: OscarConfig, mu_k: torch.Tensor | None = None
                       ) -> tuple[tuple[torch.Tensor, ...] | None, QuantizedRows | None]:
        """Window rows ``x [B, Hk, n, D]`` (``kind`` "k" or "v") as history entries ``(coded, int2)``, each None
        without such heads. ``mu_k [B, H2, D]``: a per-sequence key offset in place of the calibrated one."""
        coded = self.encode_coded(x)
        if not self.int2_heads:
            return coded, None
        if kind == "k":
            r, mu, clip = self.r_k, self.mu_k if mu_k is None else mu_k, self.clip_k
            bits, g = config.key_bits, config.group_size
        else:  # (the values' group may be their own: OscarConfig.value_group_size)
            r, mu, clip = self.r_v, self.mu_v, self.clip_v
            bits, g = config.bits, config.value_group(x.shape[-1])
        return coded, rotate_quantize(self.int2_part(x), r, mu, clip, g, config.torch_meta_dtype,
                                      use_kernels=config.use_kernels, quantizer=config.quantizer, bits=bits)

    def merge(self, int2_part: torch.Tensor | None, coded_part: torch.Tensor) -> torch.Tensor:
        """``[B, H2, ...]`` (or None) and ``[B, P, ...]`` -> ``[B, Hk, ...]`` at their heads."""
        return merge_heads(int2_part, coded_part, self.int2_idx, self.coded_idx,
                           len(self.int2_heads) + len(self.coded_heads))
