"""KV-cache methods behind one interface (kvpress style: a new method is one new entry in ``METHODS``).

Every method is a :class:`KVMethod` with

* ``fake_spec(model)``: a :class:`~oscar_hf.eval.fakequant.FakeQuantSpec` for the one-forward
  scorer, ``None`` for "no quantization" (plain forward), or raises ``NotImplementedError`` when
  the method has no teacher-forced equivalent (then only the token-by-token path scores it);
* ``make_cache(model)``: a fresh ``transformers.Cache`` for generation / token-by-token scoring;
* ``bits(T, head_dim, prefill_len)``: effective bits per KV element after ``T`` cached tokens, counted
  the same way for every row: codes + metadata (16-bit scale/zero/norm) of the quantized tokens +
  16 bits (BF16) for every token kept in full precision (sink, recent window, KIVI residual).

Rows: ``fp`` (DynamicCache), ``bf16-kv`` (keys/values rounded to bf16), ``identity`` (naive INT2),
``hadamard``, ``oscar``, ``pca-kv`` (OscarCache with a rotation; calibrated ones take an artifact),
``kivi`` (KIVI-style: per-channel keys grouped along tokens, per-token values, full-precision
residual), ``turbo`` (TurboQuant-style: random rotation, per-vector norm, Lloyd–Max levels for a
Gaussian), ``hf-quanto`` / ``hf-hqq`` (Transformers' ``QuantizedCache``, token-by-token only).
"""
from __future__ import annotations

import functools

import torch
from transformers import DynamicCache

from oscar_hf import OscarCache, OscarConfig, OscarRotations
from oscar_hf.cache.params import LayerParams
from oscar_hf.config import artifact_settings, renamed_keywords
from oscar_hf.layer_choice import choose_layers, resolve_retrieval_heads
from oscar_hf.kernels.write_path import rotate_quantize_reference
from oscar_hf.quant import dequantize_rows

from .baselines import HFQuantized, Kivi, KiviSpec, Turbo, TurboSpec, lloyd_max_gaussian  # noqa: F401
from .fakequant import FakeQuantSpec, minmax_fake_quant, window_exact_mask
from .kv_method import FP_BITS, KVMethod, mix_bits, window_counts


# ------------------------------------------------------------------------------------------ full precision
class FullPrecision(KVMethod):
    name = "fp"

    def fake_spec(self, model):
        return None

    def make_cache(self, model):
        return DynamicCache(config=model.config)

    def bits(self, T, head_dim, prefill_len=1):
        return float(FP_BITS)


class _RoundSpec(FakeQuantSpec):
    def __init__(self, dtype):
        self.dtype = dtype

    def layer_kv(self, i, k, v):
        return k.to(self.dtype).to(k.dtype), v.to(self.dtype).to(v.dtype)

    def exact_mask(self, n, prefill_len, device):  # every cached token (the query's own too) is rounded
        p = torch.arange(n, device=device)[:, None]
        return (p < prefill_len).expand(n, n)


class BF16KV(KVMethod):
    """Keys and values rounded to bf16 (what a BF16 DynamicCache stores) on a float32 model."""

    name = "bf16-kv"

    def fake_spec(self, model):
        return _RoundSpec(torch.bfloat16)

    def bits(self, T, head_dim, prefill_len=1):
        return float(FP_BITS)


# ------------------------------------------------------------------------------------------ OSCAR family
class OscarSpec(FakeQuantSpec):
    """OscarCache's history reconstruction: ``dequant(quant((x - mu) R)) Rᵀ + mu`` per layer."""

    def __init__(self, model, rotations: OscarRotations, config: OscarConfig, levels: str = "uniform"):
        if levels not in ("uniform", "lloyd-max"):
            raise ValueError(f"levels must be 'uniform' or 'lloyd-max', got {levels!r}")
        # per group, in units of its standard deviation: Lloyd-Max's levels; "uniform" is the cache's even grid
        # (OscarConfig.quantizer: min-max or mean / std)
        self.levels = {"lloyd-max": lloyd_max_gaussian(4), "uniform": None}[levels]
        if config.key_offset != "calibrated":
            raise NotImplementedError("the fake-quant path models key_offset='calibrated' only; score "
                                      "key_offset='prefill' token by token through OscarCache")
        choice = choose_layers(model, rotations, config)  # the layers, group size and retrieval heads OscarCache gets
        self.rot, self.config, self.choice = choice.rotations, choice.config, choice
        self.retrieval_heads = choice.retrieval_heads  # {layer: kv heads}
        self._dev_cache = {}

    def _params(self, i, num_kv_heads, device) -> LayerParams:
        """Layer ``i``'s parameters on ``device``, as the cache builds them (its INT2 heads' rotations and offsets,
        clips, retrieval heads)."""
        key = (i, str(device))
        if key not in self._dev_cache:
            self._dev_cache[key] = LayerParams.build(self.config, self.rot.layers[i], i, num_kv_heads,
                                                     self.retrieval_heads.get(i, ()), device)
        return self._dev_cache[key]

    def _fq(self, x, r, mu, clip, bits=2, kind="k"):
        """``x`` through the cache's write and read of ``kind`` ("k" / "v": the values' group may be their own)."""
        g, meta = self.config.group_size, self.config.torch_meta_dtype
        if kind == "v":
            g = self.config.value_group(x.shape[-1])
        if self.levels is not None:
            if bits != 2 or g != self.config.group_size:
                raise NotImplementedError("eval-only levels are 4-level (2-bit) quantizers at one group size: "
                                          "key_bits=2, value_group_size None only")
            xh = torch.matmul(self._std_levels(x, r, mu), r.transpose(-1, -2).unsqueeze(0))
        else:
            q = rotate_quantize_reference(x, r, mu, clip, g, meta, quantizer=self.config.quantizer, bits=bits)
            xh = torch.matmul(dequantize_rows(q, g), r.transpose(-1, -2).unsqueeze(0))
        return xh + mu[None, :, None, :] if mu is not None else xh

    def _std_levels(self, x, r, mu):
        """The rotated, centered rows through a 4-level quantizer per group in units of the group's spread: each
        group of ``G`` channels stores its mean and standard deviation (the two metadata values of the uniform
        quantizer's scale and zero, same bits) and 2-bit codes of the nearest of ``self.levels`` (Lloyd-Max, the
        authors' newer variant: +-0.453, +-1.510); no clipping."""
        g, meta = self.config.group_size, self.config.torch_meta_dtype
        xf = x.float() - (mu[None, :, None, :] if mu is not None else 0)
        rows = torch.matmul(xf, r.float().unsqueeze(0))  # [B, Hk, T, D]
        xg = rows.reshape(*rows.shape[:-1], rows.shape[-1] // g, g)
        m = xg.mean(-1, keepdim=True).to(meta).float()
        sd = (xg - m).pow(2).mean(-1, keepdim=True).sqrt().to(meta).float()
        lv = self.levels.to(x.device)
        code = ((xg - m) / sd.clamp_min(1e-30)).unsqueeze(-1).sub(lv).abs().argmin(-1)
        return (m + sd * lv[code]).reshape(rows.shape)

    def layer_kv(self, i, k, v):
        if not self.choice.quantized(i):  # skipped, without a rotation, or every head exact: the cache keeps it whole
            return None
        p = self._params(i, k.shape[1], k.device)
        if not p.coded_heads:
            return (self._fq(k, p.r_k, p.mu_k, p.clip_k, self.config.key_bits),
                    self._fq(v, p.r_v, p.mu_v, p.clip_v, kind="v"))
        # retrieval heads: every position as the cache stores them (OscarConfig.retrieval_bits: exact at
        # 16, else min-max codes per token and head; the window positions below still read exact, as for every head)
        q, c = list(p.int2_heads), list(p.coded_heads)
        kh, vh = k.float().clone(), v.float().clone()
        if p.bits != 16:
            kh[:, c] = minmax_fake_quant(k[:, c], p.bits, k.dtype).float()
            vh[:, c] = minmax_fake_quant(v[:, c], p.bits, v.dtype).float()
        if not q:  # a whole layer of INT4 / INT8 heads: no INT2 head left in it
            return kh, vh
        kh[:, q] = self._fq(k[:, q], p.r_k, p.mu_k, p.clip_k, self.config.key_bits).float()
        vh[:, q] = self._fq(v[:, q], p.r_v, p.mu_v, p.clip_v, kind="v").float()
        return kh, vh

    def exact_mask(self, n, prefill_len, device):
        return window_exact_mask(n, prefill_len, self.config.sink, self.config.recent, device)


class OscarFamily(KVMethod):
    """OscarCache with a rotation: built-in ``identity``/``hadamard`` (no artifact) or an artifact."""

    def __init__(self, name: str = "oscar", rotations: OscarRotations | None = None, method: str | None = None,
                 levels: str = "uniform", **config):
        self.name, self.levels = name, levels
        self.rotations = rotations
        self.method = method or (rotations.method if rotations is not None else "hadamard")
        # an artifact's chosen settings (calibrate's search) first, as OscarCache does; the keywords given win
        chosen = (artifact_settings(rotations.metadata) if rotations is not None else None) or {}
        config = renamed_keywords(config, "OscarFamily")
        self.config = OscarConfig(**{**chosen, **({"method": self.method} if rotations is None else {}), **config})
        # the fake-quant path models the calibrated key offset only: key_offset="prefill" is scored token by token
        self.fast = self.config.key_offset == "calibrated"

    def _rot(self, model):
        if self.rotations is None:
            self.rotations = OscarRotations.builtin(model, self.config.method)
        return self.rotations

    def fake_spec(self, model):
        return OscarSpec(model, self._rot(model), self.config, self.levels)

    def make_cache(self, model):
        if self.levels != "uniform":
            raise NotImplementedError(f"levels={self.levels!r} is an eval-only quantizer (fast path): no cache has it")
        return OscarCache(model, self._rot(model), self.config)

    def bits(self, T, head_dim, prefill_len=1):
        c = self.config.for_head_dim(head_dim)  # group_size=None: one group (one scale + zero) per head
        n_fp, n_q = window_counts(T, c.sink, c.recent)
        share = self.retrieval_share()
        # a retrieval head counted at every position (at retrieval_head_bits) on top of the window buffers of all
        # heads: an upper bound (the OSCAR layer codes only its history entries), kept so that the settings search
        # and the published bits stay those measured
        return (mix_bits(n_fp, n_q, c.history_bits(head_dim, share))
                + share * c.retrieval_head_bits(head_dim) * n_fp / max(T, 1))

    def retrieval_share(self) -> float:
        """Fraction of the quantized layers' KV heads kept in full precision (``retrieval_heads``, resolved
        as OscarCache does: ``"auto"`` by the artifact's retrieval scores and ``max_history_bits``)."""
        c = self.config
        if c.retrieval_heads in (0, ()):
            return 0.0
        if self.rotations is None:
            if c.retrieval_heads == "auto":
                return 0.0  # built-in rotations have no retrieval scores
            raise ValueError("retrieval_heads needs the rotations to count the quantized heads")
        n_heads = len(self.rotations.layers) * self.rotations.fingerprint.num_key_value_heads
        return len(self.retrieval_pairs()) / n_heads

    def retrieval_pairs(self) -> list[tuple[int, int]]:
        """The ``(layer, kv_head)`` pairs kept in full precision (needs the rotations; resolved once per artifact)."""
        if getattr(self, "_fp_pairs", (None,))[0] is not self.rotations:
            c, fp = self.config, self.rotations.fingerprint
            heads = resolve_retrieval_heads(c.for_head_dim(fp.head_dim), self.rotations, fp,
                                                 c.skipped(fp.num_layers))
            self._fp_pairs = (self.rotations, sorted((i, h) for i, hs in heads.items() for h in hs))
        return self._fp_pairs[1]

    def settings(self):
        c = self.config
        d = dict(method=self.method, sink=c.sink, recent=c.recent, group_size=c.group_size, center=c.center)
        if self.rotations is not None and c.retrieval_heads not in (0, ()):
            d["retrieval_heads"] = len(self.retrieval_pairs())
            if c.retrieval_heads == "auto":
                d["retrieval_heads_rule"] = (f"auto (score >= {c.retrieval_threshold:g}, "
                                                  f"<= {c.max_history_bits:g} bits)")
        if self.rotations is not None:
            d["artifact"] = self.rotations.metadata.get("path", self.rotations.method)
            d["offsets"] = self.rotations.has_offsets
        return d


# ------------------------------------------------------------------------------------------ registry
METHODS = {
    "fp": FullPrecision,
    "bf16-kv": BF16KV,
    "identity": functools.partial(OscarFamily, "identity", method="identity"),
    "hadamard": functools.partial(OscarFamily, "hadamard", method="hadamard"),
    "oscar": OscarFamily,  # give rotations=OscarRotations (an artifact)
    "pca-kv": functools.partial(OscarFamily, "pca-kv"),
    "kivi": Kivi,
    "turbo": Turbo,
    "hf-quanto": functools.partial(HFQuantized, "hf-quanto", "quanto"),
    "hf-hqq": functools.partial(HFQuantized, "hf-hqq", "hqq"),
}


def get_method(name: str, **kwargs) -> KVMethod:
    """``get_method("oscar", rotations=rot, sink=64, recent=256)``; unknown names raise ValueError."""
    if name not in METHODS:
        raise ValueError(f"unknown KV method {name!r}; known: {sorted(METHODS)}")
    return METHODS[name](**kwargs)


def with_label(method: KVMethod, label: str) -> KVMethod:
    method.name = label
    return method


__all__ = ["KVMethod", "METHODS", "get_method", "with_label", "OscarFamily", "Kivi", "Turbo", "HFQuantized",
           "FullPrecision", "BF16KV", "lloyd_max_gaussian"]
