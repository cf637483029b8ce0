"""The comparison's baselines beside OSCAR (``METHODS`` in :mod:`.methods`): KIVI-style, TurboQuant-style (fake-quant
only) and Transformers' own ``QuantizedCache`` (token by token only)."""
from __future__ import annotations

import functools
import math

import torch

from oscar_hf.quant import dequantize_rows, quantize_rows

from .fakequant import FakeQuantSpec, minmax_fake_quant, residual_exact_mask, window_exact_mask
from .kv_method import FP_BITS, KVMethod, mix_bits, window_counts


# ------------------------------------------------------------------------------------------ KIVI-2
class KiviSpec(FakeQuantSpec):
    def __init__(self, bits, group_size, residual, meta_dtype):
        self.bits, self.g, self.residual, self.meta = bits, group_size, residual, meta_dtype

    def _uniform(self, x, g):  # per-row asymmetric uniform quantization in groups of g along the last dim
        if self.bits == 2:
            return dequantize_rows(quantize_rows(x, g, 1.0, self.meta), g)
        xg = x.float().reshape(*x.shape[:-1], -1, g)
        return minmax_fake_quant(xg, self.bits, self.meta).reshape(x.shape)

    def layer_kv(self, i, k, v):
        b, h, n, d = k.shape
        g = self.g
        full = (n // g) * g
        k_hat = k.float().clone()
        if full:  # keys: per channel, groups of g consecutive tokens
            kg = k[:, :, :full].float().reshape(b, h, full // g, g, d).transpose(-1, -2)  # [.., n/g, d, g]
            k_hat[:, :, :full] = self._uniform(kg, g).transpose(-1, -2).reshape(b, h, full, d)
        v_hat = self._uniform(v.float(), min(g, d))  # values: per token, groups of g channels
        return k_hat, v_hat

    def exact_mask(self, n, prefill_len, device):
        return residual_exact_mask(n, prefill_len, self.residual, device)


class Kivi(KVMethod):
    """KIVI-style cache (Liu et al. 2024), fake-quant only: keys per channel in groups of ``group_size``
    tokens, values per token in groups of ``group_size`` channels, 16-bit scale + zero per group;
    the last ``T mod residual`` tokens stay in full precision (flushed in blocks of ``residual``)."""

    def __init__(self, name="kivi", bits=2, group_size=64, residual=128, meta_dtype="bfloat16"):
        if residual % group_size:
            raise ValueError("KIVI needs residual to be a multiple of group_size (whole token groups are flushed)")
        self.name, self.nbits, self.group_size, self.residual, self.meta_dtype = name, bits, group_size, residual, meta_dtype

    def fake_spec(self, model):
        return KiviSpec(self.nbits, self.group_size, self.residual, getattr(torch, self.meta_dtype))

    def bits(self, T, head_dim, prefill_len=1):
        n_q = (T // self.residual) * self.residual
        g_v = min(self.group_size, head_dim)
        q_bits = self.nbits + 0.5 * (32 / self.group_size + 32 / g_v)  # keys and values, 2 x 16-bit metadata
        return mix_bits(T - n_q, n_q, q_bits)


# ------------------------------------------------------------------------------------------ TurboQuant-style
@functools.lru_cache(maxsize=None)
def lloyd_max_gaussian(levels: int, iters: int = 200) -> torch.Tensor:
    """Optimal scalar quantizer levels (MSE) for N(0, 1), by Lloyd's iteration on the exact density."""
    c = torch.linspace(-2.0, 2.0, levels, dtype=torch.float64)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(iters):
        edges = torch.cat([-inf, (c[:-1] + c[1:]) / 2, inf])
        pdf = torch.exp(-0.5 * edges.clamp(-40, 40) ** 2) / math.sqrt(2 * math.pi)  # 0 at +-inf
        mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])
        c = (pdf[:-1] - pdf[1:]) / mass  # each cell's conditional mean
    return c.float()


class TurboSpec(FakeQuantSpec):
    def __init__(self, bits, sink, recent, seed, norm_dtype):
        self.levels = lloyd_max_gaussian(2**bits)
        self.sink, self.recent, self.seed, self.norm_dtype = sink, recent, seed, norm_dtype
        self._rot = {}

    def _rotation(self, i, kind, h, d, device):
        key = (i, kind, h, d)
        if key not in self._rot:
            gen = torch.Generator().manual_seed(self.seed * 100003 + 2 * i + (kind == "v"))
            q, r = torch.linalg.qr(torch.randn(h, d, d, generator=gen, dtype=torch.float64))
            q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2)  # Haar-distributed
            self._rot[key] = q.float()
        return self._rot[key].to(device)

    def _fq(self, x, r):
        d = x.shape[-1]
        xr = torch.matmul(x.float(), r.unsqueeze(0))
        norm = xr.norm(dim=-1, keepdim=True).to(self.norm_dtype).float()
        u = xr / xr.norm(dim=-1, keepdim=True).clamp_min(1e-30) * math.sqrt(d)  # coordinates ~ N(0, 1)
        lv = self.levels.to(x.device)
        code = (u.unsqueeze(-1) - lv).abs().argmin(-1)
        return torch.matmul(lv[code] / math.sqrt(d) * norm, r.transpose(-1, -2).unsqueeze(0))

    def layer_kv(self, i, k, v):
        h, d = k.shape[1], k.shape[-1]
        return self._fq(k, self._rotation(i, "k", h, d, k.device)), self._fq(v, self._rotation(i, "v", h, d, v.device))

    def exact_mask(self, n, prefill_len, device):
        return window_exact_mask(n, prefill_len, self.sink, self.recent, device)


class Turbo(KVMethod):
    """TurboQuant-style (MSE variant), fake-quant only: a random orthogonal rotation per layer and KV
    head, the vector's norm in 16 bits, each normalized coordinate to the nearest of ``2**bits``
    Lloyd–Max levels for a Gaussian. ``sink=0, recent=0``: every token but the query's own is quantized."""

    def __init__(self, name="turbo", bits=3, sink=0, recent=0, seed=0):
        self.name, self.nbits, self.sink, self.recent, self.seed = name, bits, sink, recent, seed

    def fake_spec(self, model):
        return TurboSpec(self.nbits, self.sink, self.recent, self.seed, torch.bfloat16)

    def bits(self, T, head_dim, prefill_len=1):
        n_fp, n_q = window_counts(T, self.sink, self.recent) if self.recent or self.sink else (0, T)
        return mix_bits(n_fp, n_q, self.nbits + FP_BITS / head_dim)


# ------------------------------------------------------------------------------------------ Transformers' QuantizedCache
class HFQuantized(KVMethod):
    """Transformers' ``QuantizedCache`` (quanto / HQQ backend): re-quantizes the dequantized history
    with the residual every ``residual`` steps, so it has no one-forward equivalent (token by token only)."""

    fast = False

    def __init__(self, name="hf-quanto", backend="quanto", nbits=2, group_size=64, residual=128, axis_key=None,
                 axis_value=None):
        self.name, self.backend, self.nbits, self.group_size, self.residual = name, backend, nbits, group_size, residual
        default_axis = 0 if backend == "quanto" else 1
        self.axis_key = default_axis if axis_key is None else axis_key
        self.axis_value = default_axis if axis_value is None else axis_value

    def make_cache(self, model):
        from transformers import QuantizedCache

        return QuantizedCache(self.backend, model.config, nbits=self.nbits, q_group_size=self.group_size,
                              residual_length=self.residual, axis_key=self.axis_key, axis_value=self.axis_value)

    def bits(self, T, head_dim, prefill_len=1):
        n_fp = max(0, T - prefill_len) % self.residual  # the prompt is quantized at prefill
        return mix_bits(n_fp, T - n_fp, self.nbits + 32 / self.group_size)
