"""Passes 1 and 2 of calibration: streaming float64 attention statistics (``Σx``, ``Σxᵀx``, counts) per
full-attention layer and KV head, no activation stored (docs/calibration.md)."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..config import ModelFingerprint
from ..patching import base_attention_function
from .hooks import as_sequences, progress_bar, run_windows, token_validity


def _rows(x: torch.Tensor, hk: int, valid: torch.Tensor) -> torch.Tensor:
    """``x [B, H, L, D]`` -> ``[Hk, rows, D]``: the rows of the heads sharing each KV head (repeat_kv's order), real
    tokens (``valid [B, L]``) only."""
    b, h, l, d = x.shape
    x = x.reshape(b, hk, (h // hk) * l, d).transpose(0, 1)  # [Hk, B, g*L, D]
    if bool(valid.all()):
        return x.reshape(hk, -1, d)
    m = valid[:, None, :].expand(b, h // hk, l).reshape(b, -1)  # [B, g*L]
    return x[:, m]


@dataclasses.dataclass
class LayerStats:
    """Float64 sums for one layer, ``[Hk, ...]`` each. Query and output rows are pooled over each KV head's ``g``
    query heads (``n_q`` counts tokens x g, ``n_kv`` tokens). ``sw_*``: ``Σ w_t``, ``Σ w_t v_t``, ``Σ w_t v_tᵀ v_t``,
    ``w_t = k_t C_Q k_tᵀ``."""

    qq: torch.Tensor
    k_sum: torch.Tensor
    kk: torch.Tensor
    v_sum: torch.Tensor
    vv: torch.Tensor
    o_sum: torch.Tensor
    oo: torch.Tensor
    n_q: int = 0
    n_kv: int = 0
    sw_w: torch.Tensor | None = None
    sw_v: torch.Tensor | None = None
    sw_vv: torch.Tensor | None = None

    @classmethod
    def zeros(cls, hk: int, d: int, device) -> "LayerStats":
        z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=device)  # noqa: E731
        return cls(z(hk, d, d), z(hk, d), z(hk, d, d), z(hk, d), z(hk, d, d), z(hk, d), z(hk, d, d))

    def _mean(self, x_sum: torch.Tensor, n: int) -> torch.Tensor:
        if self.n_q == 0 or self.n_kv == 0:
            raise ValueError("no tokens were recorded for this layer")
        return x_sum / n

    @property
    def mu_k(self) -> torch.Tensor:
        return self._mean(self.k_sum, self.n_kv)

    @property
    def mu_v(self) -> torch.Tensor:
        return self._mean(self.v_sum, self.n_kv)

    def c_q(self) -> torch.Tensor:
        """``C_Q = (1/N) Σ qᵀq`` of the pooled post-RoPE queries, never centered."""
        return self._mean(self.qq, self.n_q)

    @staticmethod
    def _moment(xx, x_sum, n, mu, center):
        c = xx / n
        if center:  # E[(x-mu)ᵀ(x-mu)] = E[xᵀx] - muᵀ x̄ - x̄ᵀ mu + muᵀ mu
            xbar = x_sum / n
            m, xb = mu[:, :, None], xbar[:, :, None]
            c = c - m * xbar[:, None, :] - xb * mu[:, None, :] + m * mu[:, None, :]
        return c

    # (c_s, c_k, c_v: reading mu_v / mu_k checks that tokens were recorded)
    def c_s(self, center: bool = False) -> torch.Tensor:
        """``C_S = (1/N) Σ oᵀo`` over attention outputs, centered around ``mu_V``."""
        return self._moment(self.oo, self.o_sum, self.n_q, self.mu_v, center)

    def c_k(self, center: bool = False) -> torch.Tensor:
        return self._moment(self.kk, self.k_sum, self.n_kv, self.mu_k, center)

    def c_v(self, center: bool = False) -> torch.Tensor:
        return self._moment(self.vv, self.v_sum, self.n_kv, self.mu_v, center)

    def c_sw(self, center: bool = False) -> torch.Tensor:
        """The reference implementation's value target ``Σ_t w_t v_tᵀ v_t / Σ_t w_t``, ``w_t = k_t C_Q k_tᵀ``."""
        if self.sw_w is None:
            raise ValueError("score-weighted statistics were not collected (second pass missing)")
        w = self.sw_w.clamp_min(1e-300)[:, None, None]
        return self._moment(self.sw_vv / w, self.sw_v / w[..., 0], 1, self.mu_v, center)


class StatsRecorder:
    """Accumulates :class:`LayerStats`: ``phase="moments"`` the moments, ``"score_weighted"`` (a second pass, once
    ``C_Q`` is known) the score-weighted sums. ``kv_skip``: real tokens per sequence left out of the K/V statistics
    (the cache keeps them in the sink)."""

    def __init__(self, layers, kv_skip: int = 0):
        self.layers = set(int(i) for i in layers)
        self.kv_skip = int(kv_skip)
        self.stats: dict[int, LayerStats] = {}
        self.phase = "moments"
        self._cq: dict[int, torch.Tensor] = {}

    def start_score_weighted(self) -> None:
        self.phase = "score_weighted"
        self._cq = {i: s.c_q() for i, s in self.stats.items()}
        for s in self.stats.values():  # [Hk], [Hk, D], [Hk, D, D] float64
            s.sw_w, s.sw_v, s.sw_vv = torch.zeros_like(s.k_sum[:, 0]), torch.zeros_like(s.k_sum), torch.zeros_like(s.kk)

    def __call__(self, module, query, key, value, attention_mask, *args, base, **kwargs):
        i = getattr(module, "layer_idx", None)
        if i not in self.layers:
            return NotImplemented
        result = base_attention_function(module, base)(module, query, key, value, attention_mask, *args, **kwargs)
        b, hq, q_len, d = query.shape
        hk, kv_len = key.shape[1], key.shape[2]
        vq, vk = token_validity(attention_mask, b, q_len, kv_len, key.device)
        if i not in self.stats:
            self.stats[i] = LayerStats.zeros(hk, d, key.device)
        s = self.stats[i]
        vkk = vk & (vk.cumsum(1) > self.kv_skip) if self.kv_skip else vk
        kd = _rows(key, hk, vkk).double()  # [Hk, n, D] real tokens only
        vd = _rows(value, hk, vkk).double()
        if self.phase == "score_weighted":
            w = ((kd @ self._cq[i]) * kd).sum(-1)  # [Hk, n]: w_t = k_t C_Q k_tᵀ
            s.sw_w += w.sum(1)
            s.sw_v += (w[..., None] * vd).sum(1)
            s.sw_vv += (vd * w[..., None]).transpose(1, 2) @ vd
            return result
        out = result[0] if isinstance(result, tuple) else result
        if tuple(out.shape) != (b, q_len, hq, d):
            raise NotImplementedError(f"attention returned an output of shape {tuple(out.shape)}, expected "
                                      f"[B, q, Hq, D] = {(b, q_len, hq, d)}")
        out = out.transpose(1, 2)  # [B, Hq, q, D]
        qd = _rows(query, hk, vq).double()  # [Hk, n*g, D]
        od = _rows(out, hk, vq).double()  # padded rows (possibly NaN) are dropped, not multiplied
        s.qq += qd.transpose(1, 2) @ qd
        for x_sum, xx, x in ((s.k_sum, s.kk, kd), (s.v_sum, s.vv, vd), (s.o_sum, s.oo, od)):
            x_sum += x.sum(1)  # (in place: the layer's own sums)
            xx += x.transpose(1, 2) @ x
        s.n_q += qd.shape[1]
        s.n_kv += kd.shape[1]
        return result


def spectrum_summary(c: torch.Tensor) -> dict:
    """Per KV head of ``c [Hk, D, D]`` (PSD): eigenvalues normalized to sum 1 (descending), the top one's share, the
    effective rank ``exp(entropy)``."""
    w = torch.linalg.eigvalsh(((c + c.transpose(-1, -2)) / 2).double()).flip(-1).clamp_min(0)
    p = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return {
        "top_share": [round(float(x), 5) for x in p[:, 0]],
        "eff_rank": [round(float(x), 3) for x in torch.exp(ent)],
        "eigvals": [[float(f"{float(x):.4g}") for x in row] for row in p]}


@dataclasses.dataclass
class CalibrationStats:
    """Accumulated statistics of every full-attention layer (see :class:`LayerStats`)."""

    fingerprint: ModelFingerprint
    layers: dict[int, LayerStats]
    tokens: int
    windows: int

    def spectra(self) -> dict[int, dict[str, dict]]:
        return {i: {"C_Q": spectrum_summary(s.c_q()), "C_K": spectrum_summary(s.c_k())}
                for i, s in sorted(self.layers.items())}


def full_attention_layers(fp: ModelFingerprint) -> list[int]:
    return [i for i, t in enumerate(fp.layer_types) if t == "full_attention"]


def collect_statistics(model, input_ids, *, score_weighted: bool = False, kv_skip: int = 0, batch_size: int = 1,
                       pad_id: int = 0, progress: bool = False, _bar=None) -> CalibrationStats:
    """The statistics of every full-attention layer over ``input_ids`` (``[n, L]`` or 1-D sequences, right-padded
    per batch); ``score_weighted``: the second pass too."""
    fp = ModelFingerprint.from_config(model.config)
    layers = full_attention_layers(fp)
    if not layers:
        raise ValueError(f"{fp.architecture} has no full-attention layers: nothing for OSCAR to calibrate")
    seqs = as_sequences(input_ids)
    rec = StatsRecorder(layers, kv_skip)
    passes = 2 if score_weighted else 1
    with progress_bar(progress, passes * math.ceil(len(seqs) / batch_size), "OSCAR statistics", _bar) as bar:
        run_windows(model, rec, seqs, batch_size, pad_id, bar, passes)
    if missing := [i for i in layers if i not in rec.stats]:
        raise RuntimeError(
            f"the calibration hook saw no attention call for layers {missing[:8]}; does this model route attention "
            "through transformers' attention interface (config._attn_implementation)?")
    return CalibrationStats(fp, rec.stats, sum(s.numel() for s in seqs), len(seqs))
