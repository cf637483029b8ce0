"""The OSCAR layer's base (parameters, checks, the key mean) and the mask helpers of the reads, serving's
too. Shapes: ``B`` rows, ``Hq`` query heads, ``Hk`` KV heads, ``g = Hq / Hk``, ``H2`` INT2 KV heads, ``L`` new
tokens, ``kv`` slots after this forward (``T + L``), ``D`` head_dim.
"""
from __future__ import annotations

import warnings

import torch
from transformers.cache_utils import CacheLayerMixin

from oscar_hf.kernels.settings import triton_enabled

from ..attention import OscarKV
from ..config import OscarConfig
from ..quant import check_group_size
from ..rotations import LayerRotation
from .params import LayerParams

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_first_keys(layer_idx: int, rotation: LayerRotation, key_states: torch.Tensor) -> None:
    """The first keys a layer sees must match its rotations (head count, head_dim) and a supported dtype."""
    if key_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"OscarCache supports model dtypes {SUPPORTED_DTYPES}, got {key_states.dtype}")
    _, hk, _, d = key_states.shape
    if rotation.r_k.shape[0] != hk or rotation.r_k.shape[-1] != d:
        raise ValueError(
            f"layer {layer_idx}: rotations are for kv_heads={rotation.r_k.shape[0]}, head_dim={rotation.r_k.shape[-1]} "
            f"but the model produced keys with kv_heads={hk}, head_dim={d}")


def check_reference_storage(config: OscarConfig, key_states: torch.Tensor) -> None:
    """Storage the Triton kernels do not take (3-bit keys or values at a group of their own at a head_dim that is no
    power of two: ``kernels_serve``) runs on the torch references: refused where kernels are required, said once where
    they would run. The values' group must divide head_dim (checked here, where head_dim is first known)."""
    global _SAID_REFERENCE
    d = key_states.shape[-1]
    if config.value_group_size is not None:
        check_group_size(d, config.value_group_size)
    if config.kernels_serve(d) or not triton_enabled(key_states, config.use_kernels):
        return
    what = ", ".join([f"key_bits={config.key_bits}"] * (config.key_bits != 2) + [
        f"value_group_size={config.value_group_size} (keys at {config.group_size})"] * config.values_own_group)
    if config.use_kernels is True:
        raise ValueError(f"OscarConfig {what} has no Triton kernels at head_dim={d} (the torch references read and "
                         "write it; the kernels take it at power-of-two head_dims): use use_kernels='auto' or False, "
                         "or INT2 keys at the values' group size")
    if not _SAID_REFERENCE:
        _SAID_REFERENCE = True
        warnings.warn(f"OscarConfig {what} at head_dim={d}: the history is written and read by the torch references, "
                      "not the Triton kernels (slower decode on CUDA); INT2 keys at the values' group size run the "
                      "kernels",
                      UserWarning, stacklevel=3)


_SAID_REFERENCE = False


class LayerKV(OscarKV):
    """The handle the OSCAR layer's ``update`` returns (no ``__slots__``: plain attribute access for dynamo)."""


class QuantizedLayerBase(CacheLayerMixin):
    """The OSCAR layer's part that is not storage: ``self.params`` (:class:`~oscar_hf.cache.params.LayerParams`, built
    at the first forward on the cache's device), the retrieval heads, the update checks and the offsets."""

    def __init__(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, retrieval_heads=()):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self._rotation_cpu = rotation  # (oscar_hf.distributed replaces it by the rank's slice under TP)
        self.retrieval_heads = tuple(sorted(set(int(h) for h in retrieval_heads)))  # KV heads kept out of INT2
        self.params: LayerParams | None = None

    @property
    def fp_heads(self) -> tuple[int, ...]:
        """The old name of :attr:`retrieval_heads` (deprecated)."""
        warnings.warn("layer.fp_heads is now layer.retrieval_heads", FutureWarning, stacklevel=2)
        return self.retrieval_heads

    mu_k_seq: torch.Tensor | None = None  # [B, H2, D] float32, key_offset="prefill" once known

    @property
    def q_heads(self) -> tuple[int, ...]:
        """The KV heads in the INT2 history."""
        return self.params.int2_heads

    def check_update(self, key_states: torch.Tensor) -> None:
        """A forward's new rows must match the batch, dtype and device the layer holds."""
        if key_states.shape[0] != self.batch_size:
            raise ValueError(
                f"OscarCache layer {self.layer_idx} holds batch size {self.batch_size}, got {key_states.shape[0]} rows "
                "(use batch_repeat_interleave / batch_select_indices, or a fresh cache)")
        if key_states.dtype != self.dtype or key_states.device != self.device:
            raise ValueError(
                f"OscarCache layer {self.layer_idx}: got {key_states.dtype} on {key_states.device}, "
                f"cache holds {self.dtype} on {self.device}")

    def offsets(self):
        """``(mu_K, mu_V)`` or None each; mu_K ``[H2, D]``, or ``[B, H2, D]`` with ``key_offset="prefill"``."""
        p = self.params
        return (self.mu_k_seq if self.mu_k_seq is not None else p.mu_k), p.mu_v

    def sequence_key_mean(self, keys: torch.Tensor) -> torch.Tensor:
        """``[B, H2, D]`` float32: per row, the mean of ``keys [B, Hk, b, D]`` from slot ``pad + S0`` on
        (``key_offset="prefill"``); a row without one takes the calibrated mu_K, or zero."""
        k = self.params.int2_part(keys)
        slot = torch.arange(k.shape[2], device=k.device)
        w = (slot[None, :] >= (self.pad + self.config.sink)[:, None]).float()  # [B, b]
        n = w.sum(1)  # [B]
        mean = torch.einsum("bt,bhtd->bhd", w, k.float()) / n.clamp(min=1)[:, None, None]
        mu = self.params.mu_k
        fallback = mu.float() if mu is not None else torch.zeros_like(mean[0])
        return torch.where((n > 0)[:, None, None], mean, fallback[None]).contiguous()

    def get_max_cache_shape(self) -> int:  # transformers < 5.2x name
        return self.get_max_length()

    def offload(self):
        raise NotImplementedError("OscarCache does not support offloading (its history is already ~7x smaller)")

    def prefetch(self):
        return None


def allowed_slots(mask: torch.Tensor | None, b: int, l: int, t_old: int, device) -> torch.Tensor:
    """Any Transformers mask (None: every slot) as bool ``[B, L, T + L]`` (True = may attend), causal."""
    kv = t_old + l
    if mask is None:  # [1, kv], made causal below
        mask = torch.ones(1, kv, dtype=torch.bool, device=device)
    if mask.dim() == 2:  # flash-style padding mask [B, kv]: add causality for the new rows
        pos = torch.arange(kv, device=mask.device)
        causal = pos[None, :] <= (t_old + torch.arange(l, device=mask.device))[:, None]
        return (mask.bool()[:, None, :kv] & causal[None]).expand(b, l, kv)
    if mask.dim() != 4:
        raise ValueError(f"unsupported attention mask shape {tuple(mask.shape)}")
    m = mask[:, 0, -l:, :kv]
    if m.dtype != torch.bool:  # additive float mask (eager): 0 = attend, large negative = masked
        m = m > torch.finfo(m.dtype).min / 2
    return m.expand(b, l, kv)


def first_real_slot(allowed: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's first attended slot in the last query row of ``allowed [B, L, kv]`` (left padding)."""
    last = allowed[:, -1, :]
    first = last.to(torch.int8).argmax(-1)
    return torch.where(last.any(-1), first, torch.full_like(first, last.shape[-1]))


def group_queries(x: torch.Tensor, hk: int) -> torch.Tensor:
    """``[B, Hq, L, D]`` -> ``[B, Hk, g*L, D]`` (query heads of one KV head, query-head-major)."""
    b, hq, l, d = x.shape
    return x.reshape(b, hk, (hq // hk) * l, d)


def mask_rows(m: torch.Tensor, g: int) -> torch.Tensor:
    """``[B, L, N]`` -> ``[B, 1, g*L, N]`` matching :func:`group_queries`'s row order."""
    b, l, n = m.shape
    return m[:, None, None].expand(b, 1, g, l, n).reshape(b, 1, g * l, n)


def logit_terms(kwargs: dict, hk: int, l: int) -> tuple[float | None, torch.Tensor | None]:
    """``(softcap, sinks)`` from the attention call's kwargs, each None without: the sinks ``s_aux [Hq]`` (one logit
    per query head of a zero-valued key) as ``[Hk, g*L]``, in :func:`group_queries`'s row order."""
    s_aux = kwargs.get("s_aux")
    if s_aux is None:
        return kwargs.get("softcap") or None, None
    g = s_aux.shape[0] // hk
    if s_aux.dim() != 1 or g * hk != s_aux.shape[0]:
        raise ValueError(f"attention sinks s_aux {tuple(s_aux.shape)} are not one logit per query head ([Hq], Hq a "
                         f"multiple of {hk} KV heads)")
    return kwargs.get("softcap") or None, s_aux.float().view(hk, g, 1).expand(hk, g, l).reshape(hk, g * l)
