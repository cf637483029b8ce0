"""Per-token asymmetric INT2 group quantization, the torch reference of the write path: the ``"minmax"`` and ``"std"``
quantizers (docs/quality.md, "The group quantizer"); layout (``D // G`` groups of ``G`` contiguous channels, codes
packed by plane) and rounding: docs/kernels.md §1. 3-bit codes (keys at ``OscarConfig.key_bits=3``) keep the INT2
planes of their low two bits as they are and add the high bit as a plane of its own (:class:`QuantizedRows3`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

BITS = 2
LEVELS = (1 << BITS) - 1  # 3: the largest INT2 code
CODES_PER_BYTE = 8 // BITS  # 4

SUPPORTED_META_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
QUANTIZERS = ("minmax", "std")
CODE_BITS = (2, 3)  # stored code widths: INT2, and 3-bit keys (OscarConfig.key_bits)
STD_STEP = 0.996  # "std": the level spacing in standard deviations (the MSE-optimal even 4-level grid for N(0, 1))


class QuantizedRows(NamedTuple):
    """Packed INT2 rows: ``codes [..., D/4] uint8``, ``scale``/``zero`` ``[..., D/G]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    hi = None  # (no high bit plane: see QuantizedRows3)
    bits = 2

    def map(self, fn) -> "QuantizedRows":
        """``fn`` applied to every stored tensor (a slice, a gather): rows of the same form."""
        return QuantizedRows(*(fn(x) for x in self))


class QuantizedRows3(NamedTuple):
    """Packed 3-bit rows (keys at ``OscarConfig.key_bits=3``): :class:`QuantizedRows`' fields, ``codes`` holding each
    code's low two bits as INT2 planes, and ``hi [..., D/8] uint8`` its high bit (:func:`pack_bits1`). A type of its
    own, so that code iterating INT2 rows as ``(codes, scale, zero)`` never meets the fourth tensor."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    hi: torch.Tensor

    bits = 3

    def map(self, fn) -> "QuantizedRows3":
        return QuantizedRows3(*(fn(x) for x in self))


def rows_from(parts) -> QuantizedRows | QuantizedRows3:
    """``(codes, scale, zero)`` or ``(codes, scale, zero, hi)`` (a sliced block of either) as their rows type."""
    return QuantizedRows(*parts) if len(parts) == 3 else QuantizedRows3(*parts)


def check_group_size(head_dim: int, group_size: int) -> None:
    """Raise a clear ValueError when ``group_size`` cannot group ``head_dim`` channels."""
    if group_size <= 0 or head_dim % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide head_dim={head_dim}: every quantization group must "
            f"cover whole channels of one head (valid group sizes here: "
            f"{sorted({g for g in (16, 32, 64, 128, 256, head_dim // 4, head_dim // 2, head_dim) if g and head_dim % g == 0})})."
        )
    if head_dim % CODES_PER_BYTE != 0:
        raise ValueError(f"head_dim={head_dim} must be a multiple of {CODES_PER_BYTE} to pack INT2 codes.")


def check_code_bits(bits: int, head_dim: int | None = None, quantizer: str = "minmax", name: str = "code bits"
                    ) -> None:
    """Raise a clear ValueError (naming ``name``) for a code width the cache does not store (2, or 3 with
    ``"minmax"`` and a ``head_dim`` of whole bytes of high bits; None: not checked)."""
    if isinstance(bits, bool) or bits not in CODE_BITS:
        raise ValueError(f"{name} must be one of {CODE_BITS}, got {bits!r}")
    if bits == 3 and quantizer != "minmax":
        raise ValueError(f"{name}=3 needs the 'minmax' quantizer (the 'std' grid has 4 levels), got "
                         f"quantizer={quantizer!r}")
    if bits == 3 and head_dim is not None and head_dim % 8:
        raise ValueError(f"head_dim={head_dim} must be a multiple of 8 to pack 3-bit codes")


def pack_bits1(bits: torch.Tensor) -> torch.Tensor:
    """``bits [..., D]`` (0 or 1) -> ``[..., D/8] uint8`` by plane: byte ``i`` holds channel ``k * D/8 + i`` at bit
    ``k`` (as :func:`pack_int2`'s planes: a byte's channels are D/8 apart)."""
    d = bits.shape[-1]
    c = bits.to(torch.uint8).reshape(*bits.shape[:-1], 8, d // 8)
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device).view(8, 1)
    return (c << shifts).sum(-2, dtype=torch.uint8)


def unpack_bits1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D/8] uint8`` -> ``[..., D] uint8`` of 0 / 1 (inverse of :func:`pack_bits1`)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device).view(8, 1)
    return ((packed.unsqueeze(-2) >> shifts) & 1).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def pack_int2(codes: torch.Tensor) -> torch.Tensor:
    """``codes [..., D]`` (integers 0..3) -> ``[..., D/4] uint8`` in the plane layout."""
    d = codes.shape[-1]
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], CODES_PER_BYTE, d // CODES_PER_BYTE)
    return c[..., 0, :] | (c[..., 1, :] << 2) | (c[..., 2, :] << 4) | (c[..., 3, :] << 6)


def unpack_int2(packed: torch.Tensor) -> torch.Tensor:
    """``[..., D/4] uint8`` -> ``codes [..., D] uint8`` (inverse of :func:`pack_int2`)."""
    # one broadcast shift [..., 1, D/4] >> [4, 1] -> planes [..., 4, D/4]: four shifts and a cat dominated CPU decode
    shifts = torch.arange(0, 2 * CODES_PER_BYTE, 2, dtype=torch.uint8, device=packed.device).view(CODES_PER_BYTE, 1)
    planes = (packed.unsqueeze(-2) >> shifts) & 3
    return planes.reshape(*packed.shape[:-1], packed.shape[-1] * CODES_PER_BYTE)


def quantize_rows(x: torch.Tensor, group_size: int, clip: float | torch.Tensor = 1.0,
                  meta_dtype: torch.dtype = torch.bfloat16, quantizer: str = "minmax", bits: int = 2) -> QuantizedRows:
    """Quantize ``x [..., D]`` per row and group to packed ``bits``-bit codes (2, or 3: ``hi`` set), in float32.
    ``clip``: a float or a tensor broadcastable to ``x.shape[:-1] + (1,)``; unused by ``"std"``."""
    d = x.shape[-1]
    check_group_size(d, group_size)
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer must be one of {QUANTIZERS}, got {quantizer!r}")
    check_code_bits(bits, d, quantizer)
    levels = (1 << bits) - 1
    xg = x.float().reshape(*x.shape[:-1], d // group_size, group_size)  # [..., n_groups, G]
    if quantizer == "std":
        mean = xg.mean(-1)  # [..., n_groups]
        std = (xg - mean.unsqueeze(-1)).square().mean(-1).sqrt()
        scale = STD_STEP * std
        zero = mean - 1.5 * scale
    else:
        lo, hi = xg.amin(-1), xg.amax(-1)  # [..., n_groups]
        if isinstance(clip, torch.Tensor):
            clip = clip.float()
        mid, half = (hi + lo) * 0.5, (hi - lo) * 0.5 * clip
        zero = mid - half  # the clipped minimum
        scale = (2.0 * half) / levels
    q, scale_m, zero_m = _codes_against_stored(xg, scale.unsqueeze(-1), zero.unsqueeze(-1), levels, meta_dtype)
    q = q.reshape(*x.shape[:-1], d).to(torch.uint8)
    codes, scale, zero = pack_int2(q & 3), scale_m.squeeze(-1), zero_m.squeeze(-1)
    return QuantizedRows(codes, scale, zero) if bits == 2 else QuantizedRows3(codes, scale, zero, pack_bits1(q >> 2))


def _codes_against_stored(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int, meta_dtype):
    """``(codes, scale, zero)``: float32 codes of ``x [..., n]`` against ``scale/zero [..., 1]`` rounded to
    ``meta_dtype`` first (so ``|x - x_hat| <= scale / 2`` holds for what is stored). A zero scale gives code 0."""
    if meta_dtype not in SUPPORTED_META_DTYPES:
        raise ValueError(f"metadata dtype {meta_dtype} is not supported; use one of {SUPPORTED_META_DTYPES}")
    scale_m, zero_m = scale.to(meta_dtype), zero.to(meta_dtype)
    scale_f, zero_f = scale_m.float(), zero_m.float()
    safe = torch.where(scale_f > 0, scale_f, torch.ones_like(scale_f))
    q = torch.round((x - zero_f) / safe).clamp_(0, levels)
    return torch.where(scale_f > 0, q, torch.zeros_like(q)), scale_m, zero_m


def rows_group_size(q: QuantizedRows | QuantizedRows3) -> int:
    """The group size stored rows were written with: ``D`` (4 codes a byte) over the scales per row. Keys and values
    may differ (``OscarConfig.value_group_size``), so a reader takes each kind's from its rows."""
    return q.codes.shape[-1] * CODES_PER_BYTE // max(q.scale.shape[-1], 1)


def dequantize_rows(q: QuantizedRows | QuantizedRows3, group_size: int | None = None,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Packed rows -> ``[..., D]`` in ``dtype`` (``group_size`` None: the rows' own, :func:`rows_group_size`)."""
    codes = unpack_int2(q.codes).float()
    if q.hi is not None:  # 3-bit codes: the high bit's plane
        codes = codes + 4.0 * unpack_bits1(q.hi).float()
    d = codes.shape[-1]
    group_size = rows_group_size(q) if group_size is None else group_size
    cg = codes.reshape(*codes.shape[:-1], d // group_size, group_size)
    x = q.zero.float().unsqueeze(-1) + cg * q.scale.float().unsqueeze(-1)
    return x.reshape(*codes.shape[:-1], d).to(dtype)


def quantize_minmax(x: torch.Tensor, bits: int, meta_dtype: torch.dtype) -> QuantizedRows:
    """``x [..., D]`` -> unpacked ``bits``-bit codes ``[..., D] uint8`` with one min-max scale and zero per row
    ``[..., 1]`` in ``meta_dtype``, unclipped: retrieval heads at 8 or 4 bits. Rounding as :func:`quantize_rows`."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"quantize_minmax: bits must be an int in [1, 8], got {bits!r}")
    xf = x.float()
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)  # [..., 1]
    levels = (1 << bits) - 1
    q, scale_m, zero_m = _codes_against_stored(xf, (hi - lo) / levels, lo, levels, meta_dtype)
    return QuantizedRows(q.to(torch.uint8), scale_m, zero_m)


def dequantize_minmax(q: QuantizedRows, dtype: torch.dtype) -> torch.Tensor:
    """Unpacked codes of :func:`quantize_minmax` -> ``[..., D]`` in ``dtype``."""
    return (q.zero.float() + q.codes.float() * q.scale.float()).to(dtype)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """``codes [..., D]`` (0..15) -> ``[..., D/2] uint8``, two planes: channel ``j`` low nibble, ``j + D/2`` high."""
    lo, hi = codes.to(torch.uint8).chunk(2, dim=-1)
    return lo | (hi << 4)


def encode_heads(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """A retrieval head's rows ``x [..., D]`` as stored: ``(x,)`` at 16 bits, else ``(codes, scale, zero)``
    (INT4 codes packed), metadata in ``x``'s dtype."""
    if bits == 16:
        return (x,)
    q = quantize_minmax(x, bits, x.dtype)
    return (pack_int4(q.codes) if bits == 4 else q.codes, q.scale, q.zero)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def bits_per_element(head_dim: int, group_size: int, meta_dtype: torch.dtype, bits: int = BITS) -> float:
    """Bits per stored history element: ``bits`` for the code + two metadata values per group."""
    return bits + 2 * torch.finfo(meta_dtype).bits / group_size
