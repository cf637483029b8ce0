"""The calibration hooks: streaming attention statistics and held-out quantization error.

Both hooks are attention *handlers* (see :mod:`oscar_hf.patching`) registered under the prefix
``oscarcalib_``. While a recorder is active (:func:`recording`), every attention call of a
full-attention layer goes through it: it runs the user's original attention implementation
(``base``), returns that result unchanged, and records what it needs from ``query [B, Hq, q, D]``
(post-RoPE), ``key``/``value [B, Hk, kv, D]`` (post-RoPE keys, what a cache stores) and the output
``[B, q, Hq, D]``. Sliding-window layers are passed through untouched (OSCAR does not quantize them).

Padding: a key/value position is a real token iff *some* query may attend to it under the
attention mask (4-D bool from the sdpa mask builder, 4-D additive float from eager, 2-D padding
masks from flash-style builders, or ``None`` = no padding). Without a KV cache (``use_cache=False``,
how calibration runs) query ``i`` is token ``kv - q + i``. Padded tokens are excluded everywhere.

Nothing here stores activations: :class:`StatsRecorder` accumulates float64 sums (Σx, Σxᵀx, counts)
and :class:`ErrorRecorder` accumulates float64 error sums of quantized candidates on the fly.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from .patching import base_attention_function, patched, register_handler
from .quant import LEVELS

PREFIX = "oscarcalib_"
_ACTIVE: list = []


def _dispatch(module, query, key, value, attention_mask, *args, base, **kwargs):
    if not _ACTIVE:
        return NotImplemented
    return _ACTIVE[-1](module, query, key, value, attention_mask, *args, base=base, **kwargs)


register_handler(PREFIX, _dispatch)


@contextlib.contextmanager
def recording(model, recorder):
    """Route ``model``'s attention through ``recorder`` (eval mode, no grad); restores the model's
    attention implementation and training mode afterwards, also on error."""
    was_training = model.training
    _ACTIVE.append(recorder)
    try:
        model.eval()
        with patched(model, PREFIX), torch.no_grad():
            yield recorder
    finally:
        _ACTIVE.remove(recorder)
        model.train(was_training)


# ---------------------------------------------------------------------------------------------- masks
def _allowed_4d(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2  # additive: 0 = attend, large negative / -inf = masked


def token_validity(attention_mask, batch: int, q_len: int, kv_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(valid_q [B, q], valid_kv [B, kv])`` booleans: which positions are real tokens."""
    if attention_mask is None:
        vk = torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    elif not isinstance(attention_mask, torch.Tensor):
        raise NotImplementedError(
            f"calibration cannot read an attention mask of type {type(attention_mask).__name__}; "
            "load the model with attn_implementation='sdpa' or 'eager'"
        )
    elif attention_mask.dim() == 2:
        vk = attention_mask[:, -kv_len:].bool()
    elif attention_mask.dim() == 4:
        vk = _allowed_4d(attention_mask[..., :kv_len]).any(dim=1).any(dim=1)
    else:
        raise NotImplementedError(f"unexpected attention mask shape {tuple(attention_mask.shape)}")
    vk = vk.to(device).expand(batch, kv_len)
    if q_len > kv_len:
        raise NotImplementedError(f"query length {q_len} exceeds key length {kv_len}")
    return vk[:, kv_len - q_len :], vk


def allowed_matrix(attention_mask, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Bool ``[B, 1 | H, q, kv]``: which key each query may attend to (causal when the mask is None)."""
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
    if attention_mask is None:
        return causal.expand(batch, 1, q_len, kv_len)
    if attention_mask.dim() == 2:
        return causal[None, None] & attention_mask[:, None, None, -kv_len:].bool().to(device)
    return _allowed_4d(attention_mask[..., :kv_len]).to(device).expand(batch, -1, q_len, kv_len)


def _output_tensor(result, batch, q_len, hq, d) -> torch.Tensor:
    out = result[0] if isinstance(result, tuple) else result
    if tuple(out.shape) != (batch, q_len, hq, d):
        raise NotImplementedError(
            f"attention returned an output of shape {tuple(out.shape)}, "
            f"expected [B, q, Hq, D] = {(batch, q_len, hq, d)}"
        )
    return out


def _rows(x: torch.Tensor, hk: int, valid: torch.Tensor) -> torch.Tensor:
    """``x [B, H, L, D]`` -> ``[Hk, rows, D]``: the rows of the (H / Hk) heads sharing each KV head, real
    tokens (``valid [B, L]``) only. Query head ``h`` belongs to KV head ``h // (H / Hk)`` (repeat_kv)."""
    b, h, l, d = x.shape
    x = x.reshape(b, hk, (h // hk) * l, d).transpose(0, 1)  # [Hk, B, g*L, D]
    if bool(valid.all()):
        return x.reshape(hk, -1, d)
    m = valid[:, None, :].expand(b, h // hk, l).reshape(b, -1)  # [B, g*L]
    return x[:, m]


# ---------------------------------------------------------------------------------------------- statistics
@dataclasses.dataclass
class LayerStats:
    """Float64 sums for one layer; every tensor has a leading KV-head axis ``[Hk, ...]``.

    Query and output rows are pooled over the ``g`` query heads of each KV head, so ``n_q`` counts
    (tokens x g) rows and ``n_kv`` counts tokens. ``sw_*`` hold the score-weighted value sums
    ``Σ w_t``, ``Σ w_t v_t``, ``Σ w_t v_tᵀ v_t`` with ``w_t = k_t C_Q k_tᵀ`` (second pass)."""

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

    # -- derived quantities (float64) --
    def _need(self):
        if self.n_q == 0 or self.n_kv == 0:
            raise ValueError("no tokens were recorded for this layer")

    @property
    def mu_k(self) -> torch.Tensor:
        self._need()
        return self.k_sum / self.n_kv

    @property
    def mu_v(self) -> torch.Tensor:
        self._need()
        return self.v_sum / self.n_kv

    def c_q(self) -> torch.Tensor:
        """``C_Q = (1/N) Σ qᵀq``: second moment of the (pooled, post-RoPE) queries (never centered:
        the logit error of a centered key is still ``Δk C_Q Δkᵀ``)."""
        self._need()
        return self.qq / self.n_q

    @staticmethod
    def _moment(xx, x_sum, n, mu, center):
        c = xx / n
        if center:  # E[(x-mu)ᵀ(x-mu)] = E[xᵀx] - muᵀ x̄ - x̄ᵀ mu + muᵀ mu
            xbar = x_sum / n
            m, xb = mu[:, :, None], xbar[:, :, None]
            c = c - m * xbar[:, None, :] - xb * mu[:, None, :] + m * mu[:, None, :]
        return c

    def c_s(self, center: bool = False) -> torch.Tensor:
        """``C_S = (1/N) Σ oᵀo`` over attention outputs; centered: around ``mu_V`` (``o - mu_V`` is exactly
        the attention-weighted centered values, the part that is quantized)."""
        self._need()
        return self._moment(self.oo, self.o_sum, self.n_q, self.mu_v, center)

    def c_k(self, center: bool = False) -> torch.Tensor:
        self._need()
        return self._moment(self.kk, self.k_sum, self.n_kv, self.mu_k, center)

    def c_v(self, center: bool = False) -> torch.Tensor:
        self._need()
        return self._moment(self.vv, self.v_sum, self.n_kv, self.mu_v, center)

    def c_sw(self, center: bool = False) -> torch.Tensor:
        """The reference implementation's value target ``Σ_t w_t v_tᵀ v_t / Σ_t w_t``, ``w_t = k_t C_Q k_tᵀ``."""
        if self.sw_w is None:
            raise ValueError("score-weighted statistics were not collected (second pass missing)")
        w = self.sw_w.clamp_min(1e-300)[:, None, None]
        return self._moment(self.sw_vv / w, self.sw_v / w[..., 0], 1, self.mu_v, center)


class StatsRecorder:
    """Accumulates :class:`LayerStats` for the given layers. ``phase="moments"`` records queries,
    keys, values and outputs; ``phase="score_weighted"`` (a second pass over the same windows, once
    ``C_Q`` of the whole set is known) records the score-weighted value sums.

    ``kv_skip``: the first ``kv_skip`` real tokens of every sequence are left out of the key / value
    statistics (means, ``C_K``, ``C_V``, score-weighted target): the cache keeps them in the sink
    window and never quantizes them, and attention-sink tokens carry atypical, huge activations.
    Queries and outputs are recorded at every position."""

    def __init__(self, layers, kv_skip: int = 0):
        self.layers = set(int(i) for i in layers)
        self.kv_skip = int(kv_skip)
        self.stats: dict[int, LayerStats] = {}
        self.phase = "moments"
        self._cq: dict[int, torch.Tensor] = {}
        self.calls = 0

    def start_score_weighted(self) -> None:
        self.phase = "score_weighted"
        self._cq = {i: s.c_q() for i, s in self.stats.items()}
        for s in self.stats.values():
            hk, d = s.k_sum.shape
            z = lambda *sh: torch.zeros(*sh, dtype=torch.float64, device=s.k_sum.device)  # noqa: E731
            s.sw_w, s.sw_v, s.sw_vv = z(hk), z(hk, d), z(hk, d, d)

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
        self.calls += 1
        vkk = vk & (vk.cumsum(1) > self.kv_skip) if self.kv_skip else vk
        kd = _rows(key, hk, vkk).double()  # [Hk, n, D] real tokens only
        vd = _rows(value, hk, vkk).double()
        if self.phase == "score_weighted":
            w = ((kd @ self._cq[i]) * kd).sum(-1)  # [Hk, n]: w_t = k_t C_Q k_tᵀ
            s.sw_w += w.sum(1)
            s.sw_v += (w[..., None] * vd).sum(1)
            s.sw_vv += (vd * w[..., None]).transpose(1, 2) @ vd
            return result
        out = _output_tensor(result, b, q_len, hq, d).transpose(1, 2)  # [B, Hq, q, D]
        qd = _rows(query, hk, vq).double()  # [Hk, n*g, D]
        od = _rows(out, hk, vq).double()  # padded rows (possibly NaN) are dropped, not multiplied
        s.qq += qd.transpose(1, 2) @ qd
        s.k_sum += kd.sum(1)
        s.kk += kd.transpose(1, 2) @ kd
        s.v_sum += vd.sum(1)
        s.vv += vd.transpose(1, 2) @ vd
        s.o_sum += od.sum(1)
        s.oo += od.transpose(1, 2) @ od
        s.n_q += qd.shape[1]
        s.n_kv += kd.shape[1]
        return result
        mq = vq[:, None, None, :, None]
        qd = torch.where(mq, query.double().view(b, hk, g, q_len, d), 0.0)
        out = _output_tensor(result, b, q_len, hq, d)
        od = torch.where(mq, out.double().transpose(1, 2).reshape(b, hk, g, q_len, d), 0.0)  # NaN rows of padding too
        s.qq += torch.einsum("bhgld,bhgle->hde", qd, qd)
        s.k_sum += kd.sum((0, 2))
        s.kk += torch.einsum("bhld,bhle->hde", kd, kd)
        s.v_sum += vd.sum((0, 2))
        s.vv += torch.einsum("bhld,bhle->hde", vd, vd)
        s.o_sum += od.sum((0, 2, 3))
        s.oo += torch.einsum("bhgld,bhgle->hde", od, od)
        s.n_q += g * int(vq.sum())
        s.n_kv += int(vk.sum())
        return result


# ---------------------------------------------------------------------------------------------- held-out error
@dataclasses.dataclass
class LayerCandidates:
    """What to evaluate in one layer: ``k_rots [Ck, Hk, D, D]``, ``v_rots [Cv, Hk, D, D]`` (row-vector
    convention, history stores ``(x - mu) @ R``), offsets ``mu_k`` (``[Hk, D]`` shared by all candidates,
    ``[Ck, Hk, D]`` one per candidate, or None) and ``mu_v``, and clip grids; optional reference
    rotations ``k_ref [Cr, Hk, D, D]`` / ``v_ref`` evaluated uncentered at clip 1.0 only (for reports)."""

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
    """Float64 error sums: ``k [Ck, Nk, Hk]``, ``v [Cv, Nv, Hk]``, counts and signal sums per KV head.

    * key: ``Σ (scaling · q_i·(k_j - k̂_j))²`` over all (query head, query, key) pairs of a sequence;
      ``k_signal`` is the same sum of ``(scaling · q_i·k_j)²``;
    * value: ``Σ ||Σ_j p_ij (v_j - v̂_j)||²`` over (query head, sampled query) with the real attention
      probabilities ``p``; ``v_signal`` is ``Σ ||o_i||²``.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_count: float = 0.0
    v_count: float = 0.0
    k_signal: torch.Tensor | None = None
    v_signal: torch.Tensor | None = None
    k_ref: torch.Tensor | None = None  # [Cr, 1, Hk]: reference rotations at clip 1.0
    v_ref: torch.Tensor | None = None

    def k_mean(self) -> torch.Tensor:
        return self.k / max(self.k_count, 1.0)

    def v_mean(self) -> torch.Tensor:
        return self.v / max(self.v_count, 1.0)

    def k_rel(self) -> torch.Tensor:
        """Key error relative to the mean squared logit, per candidate / clip / head."""
        return self.k / self.k_signal.clamp_min(1e-300)

    def v_rel(self) -> torch.Tensor:
        return self.v / self.v_signal.clamp_min(1e-300)


def quant_error(x: torch.Tensor, clips: torch.Tensor, group_size: int, meta_dtype) -> torch.Tensor:
    """``dequant(quant(x)) - x`` for each clip ratio: ``x [..., D]`` -> ``[..., N, D]`` float32 (the clip
    axis second to last).

    The same arithmetic as :func:`oscar_hf.quant.quantize_rows` followed by ``dequantize_rows``
    (bit-identical, see tests), without packing the codes and mostly in place, for speed."""
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
            self.errors[i] = LayerErrors(
                z(cand.k_rots.shape[0], cand.clips_k.numel(), hk), z(cand.v_rots.shape[0], cand.clips_v.numel(), hk),
                0.0, 0.0, z(hk), z(hk),
                None if cand.k_ref is None else z(cand.k_ref.shape[0], 1, hk),
                None if cand.v_ref is None else z(cand.v_ref.shape[0], 1, hk),
            )
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


def select_best(errors: torch.Tensor) -> tuple[int, list[int]]:
    """Joint choice for one layer from ``errors [C, N, Hk]``: one clip index for the layer and one
    candidate per KV head, minimizing the layer's summed error. Ties prefer the larger clip
    ratio (the grid is ascending) and the earlier candidate."""
    best, arg = errors.min(dim=0)  # [N, Hk]
    total = best.sum(-1)  # [N]
    n = total.numel()
    j = n - 1 - int(torch.argmin(total.flip(0)))
    return j, [int(a) for a in arg[j]]


def spectrum_summary(c: torch.Tensor) -> dict:
    """Per KV head of a ``[Hk, D, D]`` PSD matrix: descending eigenvalues normalized to sum 1, the top
    eigenvalue's share and the effective rank ``exp(entropy)``."""
    w = torch.linalg.eigvalsh(((c + c.transpose(-1, -2)) / 2).double()).flip(-1).clamp_min(0)
    p = w / w.sum(-1, keepdim=True).clamp_min(1e-300)
    ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
    return {
        "top_share": [round(float(x), 5) for x in p[:, 0]],
        "eff_rank": [round(float(x), 3) for x in torch.exp(ent)],
        "eigvals": [[float(f"{float(x):.4g}") for x in row] for row in p],
    }
