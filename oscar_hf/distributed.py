"""Tensor parallelism: each rank's cache layers get the rotations of its own KV heads (under Transformers' DTensor TP
a rank's cache sees ``[B, Hk/W, T, D]`` keys), read per layer from the sharded ``k_proj`` / ``v_proj``; docs/usage.md,
"Multi-GPU and tensor parallelism".
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from .rotations import LayerRotation

logger = logging.getLogger("oscar_hf")


@dataclasses.dataclass(frozen=True)
class HeadShard:
    """KV heads ``[start, stop)`` of one projection held by this rank."""

    start: int
    stop: int

    @property
    def n(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """This rank's KV heads in every decoder layer (``k[i]``, ``v[i]``), and how they were found."""

    rank: int
    world: int
    num_kv_heads: int
    k: dict[int, HeadShard]
    v: dict[int, HeadShard]
    source: str  # "dtensor" (read from the k_proj/v_proj weights) or "even" (rank arithmetic)

    def to_dict(self) -> dict[str, Any]:
        return dict(rank=self.rank, world=self.world, num_kv_heads=self.num_kv_heads, source=self.source,
                    k={i: (s.start, s.stop) for i, s in sorted(self.k.items())},
                    v={i: (s.start, s.stop) for i, s in sorted(self.v.items())})


def even_head_shard(num_kv_heads: int, rank: int, world: int) -> HeadShard:
    """The heads of rank ``rank`` when ``k_proj``/``v_proj`` are column-sharded evenly over ``world`` ranks."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad tensor-parallel rank {rank} of world size {world}")
    if num_kv_heads % world:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs the number of KV heads ({num_kv_heads}) to be a multiple "
            f"of the TP size: column-sharding k_proj/v_proj would otherwise split a head across ranks")
    per = num_kv_heads // world
    return HeadShard(rank * per, (rank + 1) * per)


def slice_layer_rotation(lr: LayerRotation, k: HeadShard, v: HeadShard | None = None) -> LayerRotation:
    """``lr`` restricted to KV heads ``k`` (keys) and ``v`` (values; default ``k``); clips carried over."""
    v = k if v is None else v
    for name, s, t in (("k", k, lr.r_k), ("v", v, lr.r_v)):
        if not 0 <= s.start < s.stop <= t.shape[0]:
            raise ValueError(f"KV heads [{s.start}, {s.stop}) out of range for a rotation of {t.shape[0]} heads ({name})")
    if (k.start, k.stop, v.start, v.stop) == (0, lr.r_k.shape[0], 0, lr.r_v.shape[0]):  # every head
        return lr
    return lr.map(lambda t: t[k.start : k.stop], lambda t: t[v.start : v.stop])


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return isinstance(t, DTensor)


def _dim0_range(w) -> tuple[int, int, int]:
    """``(offset, local_size, global_size)`` of a DTensor weight along dim 0 (its output features)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
    return int(offset[0]), int(shape[0]), int(w.shape[0])


def _heads_of(weight, head_dim: int, num_kv_heads: int, what: str) -> HeadShard | None:
    """The KV heads a ``k_proj``/``v_proj`` weight produces on this rank (None: not a DTensor)."""
    if not _is_dtensor(weight):
        return None
    off, size, n = _dim0_range(weight)
    if n != num_kv_heads * head_dim:
        raise ValueError(f"{what}: {n} output features, expected kv_heads*head_dim = {num_kv_heads}*{head_dim}")
    if off % head_dim or size % head_dim or size == 0:
        raise ValueError(f"{what}: this rank holds output features [{off}, {off + size}) of {n}, which is not a "
                         f"whole number of KV heads (head_dim={head_dim}); the tensor-parallel size must divide the "
                         f"number of KV heads ({num_kv_heads})")
    return HeadShard(off // head_dim, (off + size) // head_dim)


def tp_rank_world(model) -> tuple[int, int] | None:
    """``(rank, world)`` of the model's tensor-parallel group, or None when it is not tensor-parallel."""
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None:
        names = getattr(mesh, "mesh_dim_names", None) or ()
        tp = mesh["tp"] if "tp" in names else (mesh if mesh.ndim == 1 else None)
        if tp is not None and tp.size() > 1:
            return int(tp.get_local_rank()), int(tp.size())
    size = getattr(model, "_tp_size", None)
    if size and int(size) > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() % int(size), int(size)
    return None


def _attention_modules(model) -> dict[int, torch.nn.Module]:
    """Decoder-layer attention modules by ``layer_idx`` (searched inside the text decoder when there is one)."""
    try:
        root = model.get_decoder() or model
    except Exception:  # noqa: BLE001 - no get_decoder, or a wrapper that raises instead of returning None
        root = model
    out = {}
    for _, mod in root.named_modules():
        idx = getattr(mod, "layer_idx", None)
        if isinstance(idx, int) and hasattr(mod, "k_proj") and hasattr(mod, "v_proj") and idx not in out:
            out[idx] = mod
    return out


def tp_layout(model, num_kv_heads: int, head_dim: int, layers=None) -> TPLayout | None:
    """This rank's KV heads per decoder layer, or None when the model is not tensor-parallel."""
    attn = _attention_modules(model) if isinstance(model, torch.nn.Module) else {}
    ks, vs = {}, {}
    for i, mod in attn.items():
        if layers is not None and i not in layers:
            continue
        for found, proj in ((ks, "k_proj"), (vs, "v_proj")):
            s = _heads_of(getattr(getattr(mod, proj), "weight", None), head_dim, num_kv_heads, f"layer {i} {proj}")
            if s is not None:
                found[i] = s
    rw = tp_rank_world(model)
    if not ks and not vs and rw is None:
        return None
    if rw is None:  # DTensor weights without a TP group on the model (a custom parallelize): infer from the mesh
        any_w = next(getattr(m.k_proj, "weight", None) for m in attn.values())
        mesh = any_w.device_mesh if _is_dtensor(any_w) else None
        rw = (int(mesh.get_local_rank()), int(mesh.size())) if mesh is not None and mesh.ndim == 1 else (0, 1)
    rank, world = rw
    missing = [i for i in (layers if layers is not None else attn) if i not in ks or i not in vs]
    if missing and world > 1:
        logger.warning(
            "tensor parallelism: no sharded k_proj/v_proj found for layers %s; assuming the even column-sharded layout "
            "(rank %d of %d holds KV heads [%d*Hk/W, (%d+1)*Hk/W))", missing[:8], rank, world, rank, rank)
    source = "dtensor" if ks else "even"
    if world > 1:
        even = even_head_shard(num_kv_heads, rank, world)
        for i in missing:
            ks.setdefault(i, even)
            vs.setdefault(i, even)
    return TPLayout(rank, world, num_kv_heads, ks, vs, source)


def local_retrieval_heads(heads: tuple[int, ...], k: slice, v: slice, layer: int, rank: int) -> tuple[int, ...]:
    """The retrieval heads (global KV head ids) that this rank's shard ``k`` / ``v`` holds, as its local ids."""
    if (k.start, k.stop) != (v.start, v.stop):
        raise NotImplementedError(f"layer {layer}: retrieval heads need the same KV heads for keys and values on "
                                  f"a rank (rank {rank} holds keys {k.start}:{k.stop}, values {v.start}:{v.stop})")
    local = tuple(h - k.start for h in heads if k.start <= h < k.stop)
    if len(local) == k.stop - k.start:
        raise NotImplementedError(f"layer {layer}: every KV head of rank {rank} ({k.start}:{k.stop}) is a "
                                  "retrieval head; keep fewer heads or skip the layer (skip_layers)")
    return local


def shard_cache_for_tensor_parallel(cache, model) -> TPLayout | None:
    """Under tensor parallelism, give every quantized layer the rotation slice of this rank's KV heads; else None."""
    if not isinstance(model, torch.nn.Module):
        return None
    fp = cache.fingerprint
    # the quantized layers: those keeping their rotation in _rotation_cpu
    q_layers = {i for i, layer in enumerate(cache.layers) if getattr(layer, "_rotation_cpu", None) is not None}
    layout = tp_layout(model, fp.num_key_value_heads, fp.head_dim, layers=q_layers)
    if layout is None:
        return None
    for i in q_layers:
        layer = cache.layers[i]
        full = cache.rotations.layers[i]
        layer._rotation_cpu = slice_layer_rotation(full, layout.k[i], layout.v[i]) if i in layout.k else full
        if getattr(layer, "retrieval_heads", ()) and i in layout.k:  # global KV head ids -> this rank's own, if it holds them
            layer.retrieval_heads = local_retrieval_heads(layer.retrieval_heads, layout.k[i], layout.v[i], i, layout.rank)
    cache.tp_layout = layout
    logger.info("OscarCache: tensor-parallel rank %d/%d (%s), KV heads %s", layout.rank, layout.world, layout.source,
                sorted({(s.start, s.stop) for s in layout.k.values()}))
    return layout
