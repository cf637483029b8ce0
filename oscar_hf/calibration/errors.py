"""The held-out attention error of quantized candidates (:class:`ErrorRecorder`, an attention handler), summed per
layer in float64 (:class:`LayerErrors`). The measures: docs/calibration.md."""
from __future__ import annotations

import dataclasses

import torch

from ..patching import base_attention_function
from ..quant import LEVELS
from .hooks import allowed_matrix, token_validity


@dataclasses.dataclass
class LayerCandidates:
    """What to evaluate in one layer: ``k_rots [Ck, Hk, D, D]``, ``v_rots [Cv, Hk, D, D]``, offsets ``mu_k``
    (``[Hk, D]``, ``[Ck, Hk, D]`` or None) and ``mu_v``, clip grids; reference rotations ``k_ref [Cr, Hk, D, D]`` /
    ``v_ref`` evaluated uncentered at clip 1.0 only (for reports)."""

    k_rots: torch.Tensor
    v_rots: torch.Tensor
    mu_k: torch.Tensor | None
    mu_v: torch.Tensor | None
    clips_k: torch.Tensor
    clips_v: torch.Tensor
    k_ref: torch.Tensor | None = None
    v_ref: torch.Tensor | None = None


@dataclasses.dataclass
class LayerErrors:
    """Float64 sums: key ``Σ (scaling · q_i·(k_j - k̂_j))²`` over (query head, query, key) pairs, value
    ``Σ ||Σ_j p_ij (v_j - v̂_j)||²`` over (query head, sampled query); signals: the same of ``q_i·k_j`` and ``o_i``."""

    k: torch.Tensor  # [Ck, Nk, Hk]: Ck key candidates x Nk clip ratios, per KV head
    v: torch.Tensor  # [Cv, Nv, Hk]
    k_count: float = 0.0  # (query head, query, key) pairs summed into k
    v_count: float = 0.0  # (query head, sampled query) pairs summed into v
    k_signal: torch.Tensor | None = None  # [Hk]
    v_signal: torch.Tensor | None = None  # [Hk]
    k_ref: torch.Tensor | None = None  # [Cr, 1, Hk]: reference rotations at clip 1.0
    v_ref: torch.Tensor | None = None

    def k_mean(self) -> torch.Tensor:
        return self.k / max(self.k_count, 1.0)

    def v_mean(self) -> torch.Tensor:
        return self.v / max(self.v_count, 1.0)


def quant_error(x: torch.Tensor, clips: torch.Tensor, group_size: int, meta_dtype) -> torch.Tensor:
    """``dequant(quant(x)) - x`` per clip ratio: ``x [..., D]`` -> ``[..., N, D]`` float32. Bit-identical to
    :func:`oscar_hf.quant.quantize_rows` + ``dequantize_rows``, without packing and mostly in place, for speed."""
    d = x.shape[-1]
    n = clips.numel()
    xg = x.float().reshape(*x.shape[:-1], 1, d // group_size, group_size)  # [..., 1, ng, G]
    lo, hi = torch.aminmax(xg, dim=-1)  # [..., 1, ng]
    clip = clips.float().to(x.device).view(n, 1)
    mid, half = (hi + lo) * 0.5, (hi - lo) * 0.5 * clip  # [..., N, ng]
    lo_c = mid - half
    scale = (2.0 * half) / LEVELS
    scale_f = scale.to(meta_dtype).float().unsqueeze(-1)
    zero_f = lo_c.to(meta_dtype).float().unsqueeze(-1)
    pos = scale_f > 0
    all_pos = bool(pos.all())
    safe = scale_f if all_pos else torch.where(pos, scale_f, torch.ones_like(scale_f))
    q = (xg - zero_f).div_(safe).round_().clamp_(0, LEVELS)  # [..., N, ng, G] codes
    if not all_pos:
        q.masked_fill_(~pos, 0.0)
    return q.mul_(scale_f).add_(zero_f).sub_(xg).reshape(*x.shape[:-1], n, d)


class ErrorRecorder:
    """Evaluates every candidate rotation x clip ratio of each layer on held-out tokens, on the fly."""

    def __init__(self, candidates: dict[int, LayerCandidates], group_size: int, meta_dtype=torch.bfloat16,
                 query_samples: int = 128, window: tuple[int, int] | None = None):
        self.candidates = candidates
        self.window = window
        self.group_size = group_size
        self.meta_dtype = meta_dtype
        self.query_samples = query_samples
        self.errors: dict[int, LayerErrors] = {}

    def __call__(self, module, query, key, value, attention_mask, *args, base, **kwargs):
        i = getattr(module, "layer_idx", None)
        if i not in self.candidates:
            return NotImplemented
        if kwargs.get("s_aux") is not None or kwargs.get("position_bias") is not None:
            raise NotImplementedError("attention sinks / position bias are not supported by OSCAR calibration")
        result = base_attention_function(module, base)(module, query, key, value, attention_mask, *args, **kwargs)
        cand = self.candidates[i]
        b, hq, q_len, d = query.shape
        hk, kv_len = key.shape[1], key.shape[2]
        g = hq // hk
        dev = key.device
        scaling = kwargs.get("scaling")
        if scaling is None:
            scaling = getattr(module, "scaling", d**-0.5)
        softcap = kwargs.get("softcap")
        vq, vk = token_validity(attention_mask, b, q_len, kv_len, dev)
        allowed = allowed_matrix(attention_mask, b, q_len, kv_len, dev)
        if i not in self.errors:
            z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=dev)  # noqa: E731
            self.errors[i] = LayerErrors(z(cand.k_rots.shape[0], cand.clips_k.numel(), hk),
                                         z(cand.v_rots.shape[0], cand.clips_v.numel(), hk), 0.0, 0.0, z(hk), z(hk),
                                         None if cand.k_ref is None else z(cand.k_ref.shape[0], 1, hk),
                                         None if cand.v_ref is None else z(cand.v_ref.shape[0], 1, hk))
        err = self.errors[i]
        one = torch.ones(1, device=dev)
        f32 = lambda t: t.to(dev, torch.float32)  # noqa: E731

        def mus(mu, n):  # -> [n, Hk, D] or None
            if mu is None:
                return None
            mu = f32(mu)
            return mu.expand(n, *mu.shape) if mu.dim() == 2 else mu

        k_jobs = [(f32(cand.k_rots), mus(cand.mu_k, cand.k_rots.shape[0]), cand.clips_k.to(dev), err.k)]
        v_jobs = [(f32(cand.v_rots), mus(cand.mu_v, cand.v_rots.shape[0]), cand.clips_v.to(dev), err.v)]
        if cand.k_ref is not None:
            k_jobs.append((f32(cand.k_ref), None, one, err.k_ref))
        if cand.v_ref is not None:
            v_jobs.append((f32(cand.v_ref), None, one, err.v_ref))
        s2 = float(scaling) ** 2
        for bi in range(b):
            qpos = vq[bi].nonzero().squeeze(-1)
            kpos = vk[bi].nonzero().squeeze(-1)
            nq, nk = qpos.numel(), kpos.numel()
            if nq == 0 or nk == 0:
                continue
            kb = key[bi][:, kpos].float()  # [Hk, nk, D]
            vb = value[bi][:, kpos].float()
            hist = None
            if self.window is None:
                # ---- keys: pooled query Gram matrix per KV head, all (query, key) pairs of the sequence
                qg = query[bi][:, qpos].float().reshape(hk, g * nq, d)
                gram = (qg.transpose(1, 2) @ qg).double()  # [Hk, D, D]
                err.k_signal += s2 * ((kb.double() @ gram) * kb.double()).sum((-1, -2))
                for rots, mu, clips, target in k_jobs:
                    for c in range(rots.shape[0]):
                        r = rots[c]  # [Hk, D, D]
                        xk = kb if mu is None else kb - mu[c][:, None, :]
                        e = quant_error(xk @ r, clips, self.group_size, self.meta_dtype)
                        e = e.view(hk, -1, d)  # [Hk, nk*Nk, D]
                        g_rot = (r.double().transpose(1, 2) @ gram @ r.double()).float()
                        le = ((e @ g_rot) * e).sum(-1).view(hk, nk, -1).double().sum(1)  # [Hk, Nk]
                        target[c] += s2 * le.T
                err.k_count += g * nq * nk
                cand_q = qpos
            else:
                # only queries that have history keys: ordinal t_q >= sink + recent + 1
                sink, recent = self.window
                ordinal = vk[bi].cumsum(0) - 1  # position among real tokens
                tq_all = ordinal[kv_len - q_len + qpos]
                cand_q = qpos[tq_all > sink + recent]
                if cand_q.numel() == 0:
                    continue
            # ---- sampled queries (evenly spaced) and their real attention probabilities
            nc = cand_q.numel()
            ns = min(self.query_samples, nc)
            sel = cand_q[torch.linspace(0, nc - 1, ns, device=dev).round().long().unique()]
            ns = sel.numel()
            qs = query[bi][:, sel].float().reshape(hk, g * ns, d)
            logits = (qs @ key[bi].float().transpose(1, 2)) * scaling  # [Hk, g*ns, kv]
            if softcap is not None:
                logits = torch.tanh(logits / softcap) * softcap
            al = allowed[bi][:, sel]  # [1|Hq, ns, kv]
            al = al.expand(hq, ns, kv_len).reshape(hk, g * ns, kv_len)
            probs = torch.softmax(logits.masked_fill(~al, float("-inf")), dim=-1).nan_to_num(0.0)
            p = probs[:, :, kpos]  # [Hk, g*ns, nk]
            err.v_signal += ((p @ vb).double() ** 2).sum((-1, -2))
            if self.window is not None:
                # history pairs: sink <= t_k < t_q - recent (what the cache quantizes for that query)
                tq = (vk[bi].cumsum(0) - 1)[kv_len - q_len + sel]  # [ns]
                tk = torch.arange(nk, device=dev)
                hist = ((tk[None, :] >= sink) & (tk[None, :] < tq[:, None] - recent)).repeat(g, 1)  # [g*ns, nk]
                hf = hist.float()
                qsc = qs * scaling
                lsig = (qsc @ kb.transpose(1, 2)) ** 2  # [Hk, g*ns, nk]
                err.k_signal += (lsig * hf).sum((-1, -2)).double()
                for rots, mu, clips, target in k_jobs:
                    for c in range(rots.shape[0]):
                        r = rots[c]
                        xk = kb if mu is None else kb - mu[c][:, None, :]
                        e = quant_error(xk @ r, clips, self.group_size, self.meta_dtype)  # [Hk, nk, Nk, D]
                        qr = qsc @ r  # rotate the queries instead of un-rotating the errors
                        for j in range(e.shape[2]):
                            le = ((qr @ e[:, :, j].transpose(1, 2)) ** 2 * hf).sum((-1, -2)).double()
                            target[c, j] += le
                err.k_count += float(hist.sum())
                p = p * hf
            for rots, mu, clips, target in v_jobs:
                for c in range(rots.shape[0]):
                    xv = vb if mu is None else vb - mu[c][:, None, :]
                    e = quant_error(xv @ rots[c], clips, self.group_size, self.meta_dtype).view(hk, nk, -1)
                    oe = (p @ e).pow_(2).view(hk, g * ns, -1, d).sum(-1).double().sum(1)  # [Hk, Nv]
                    target[c] += oe.T
            err.v_count += g * ns
        return result
