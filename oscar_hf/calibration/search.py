"""Candidates and their selection: the rotations a layer may use, their held-out attention error for every clip
ratio (:class:`ErrorRecorder`; docs/calibration.md), :func:`select_best`'s clip per layer and candidate per KV head."""
from __future__ import annotations

import dataclasses
import math

import torch

from ..config import META_DTYPES, validate_head_dim
from ..hadamard import hadamard_matrix, oscar_rotation
from ..patching import base_attention_function
from ..quant import LEVELS
from ..rotations import OscarRotations
from .hooks import allowed_matrix, as_sequences, progress_bar, run_windows, token_validity
from .stats import CalibrationStats, LayerStats

CLIP_GRID = tuple(round(0.80 + 0.02 * i, 2) for i in range(11))  # 0.80 .. 1.00
K_CANDIDATES = ("identity", "hadamard", "oscar", "pca-kv")
V_CANDIDATES = ("identity", "hadamard", "oscar", "pca-kv", "score-weighted")


@dataclasses.dataclass
class LayerCandidates:
    """What to evaluate in one layer: ``k_rots [Ck, Hk, D, D]``, ``v_rots [Cv, Hk, D, D]``, offsets ``mu_k``
    (``[Hk, D]``, ``[Ck, Hk, D]`` or None) and ``mu_v``, clip grids; reference rotations ``ref [Cr, Hk, D, D]``
    evaluated for keys and values, uncentered at clip 1.0 only (for reports)."""

    k_rots: torch.Tensor
    v_rots: torch.Tensor
    mu_k: torch.Tensor | None
    mu_v: torch.Tensor | None
    clips_k: torch.Tensor
    clips_v: torch.Tensor
    ref: torch.Tensor | None = None


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
        self.candidates, self.window, self.group_size = candidates, window, group_size
        self.meta_dtype, self.query_samples = meta_dtype, query_samples
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
        scaling = kwargs.get("scaling") or getattr(module, "scaling", d**-0.5)  # (None: the module's)
        softcap = kwargs.get("softcap")
        vq, vk = token_validity(attention_mask, b, q_len, kv_len, dev)
        allowed = allowed_matrix(attention_mask, b, q_len, kv_len, dev)
        if i not in self.errors:
            z = lambda *s: torch.zeros(*s, dtype=torch.float64, device=dev)  # noqa: E731
            ref = () if cand.ref is None else [z(len(cand.ref), 1, hk) for _ in "kv"]  # LayerErrors.k_ref, v_ref
            self.errors[i] = LayerErrors(z(cand.k_rots.shape[0], cand.clips_k.numel(), hk),
                                         z(cand.v_rots.shape[0], cand.clips_v.numel(), hk), 0.0, 0.0, z(hk), z(hk), *ref)
        err = self.errors[i]
        one = torch.ones(1, device=dev)
        f32 = lambda t: t.to(dev, torch.float32)  # noqa: E731
        k_jobs = [(f32(cand.k_rots), cand.mu_k, cand.clips_k.to(dev), err.k)]
        v_jobs = [(f32(cand.v_rots), cand.mu_v, cand.clips_v.to(dev), err.v)]
        if cand.ref is not None:
            k_jobs.append((f32(cand.ref), None, one, err.k_ref))
            v_jobs.append((f32(cand.ref), None, one, err.v_ref))
        s2 = float(scaling) ** 2

        def errors(jobs, x):  # per candidate c: (target[c], its rotation [Hk, D, D], quant error [Hk, n, N, D])
            for rots, mu, clips, target in jobs:  # mu: [Hk, D] shared, [C, Hk, D] per candidate, or None
                for c in range(rots.shape[0]):
                    xc = x if mu is None else x - f32(mu if mu.dim() == 2 else mu[c])[:, None, :]
                    yield target[c], rots[c], quant_error(xc @ rots[c], clips, self.group_size, self.meta_dtype)

        for bi in range(b):
            qpos = vq[bi].nonzero().squeeze(-1)
            kpos = vk[bi].nonzero().squeeze(-1)
            nq, nk = qpos.numel(), kpos.numel()
            if nq == 0 or nk == 0:
                continue
            kb = key[bi][:, kpos].float()  # [Hk, nk, D]
            vb = value[bi][:, kpos].float()
            if self.window is None:
                # ---- keys: pooled query Gram matrix per KV head, all (query, key) pairs of the sequence
                qg = query[bi][:, qpos].float().reshape(hk, g * nq, d)
                gram = (qg.transpose(1, 2) @ qg).double()  # [Hk, D, D]
                err.k_signal += s2 * ((kb.double() @ gram) * kb.double()).sum((-1, -2))
                for target, r, e in errors(k_jobs, kb):
                    e = e.view(hk, -1, d)  # [Hk, nk*Nk, D]
                    g_rot = (r.double().transpose(1, 2) @ gram @ r.double()).float()
                    le = ((e @ g_rot) * e).sum(-1).view(hk, nk, -1).double().sum(1)  # [Hk, Nk]
                    target += s2 * le.T
                err.k_count += g * nq * nk
                cand_q = qpos
            else:
                # only queries that have history keys: ordinal t_q >= sink + recent + 1
                sink, recent = self.window
                ordinal = vk[bi].cumsum(0) - 1  # position among real tokens
                cand_q = qpos[ordinal[kv_len - q_len + qpos] > sink + recent]
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
                tq = ordinal[kv_len - q_len + sel]  # [ns]
                tk = torch.arange(nk, device=dev)
                hist = ((tk[None, :] >= sink) & (tk[None, :] < tq[:, None] - recent)).repeat(g, 1)  # [g*ns, nk]
                hf = hist.float()
                qsc = qs * scaling
                lsig = (qsc @ kb.transpose(1, 2)) ** 2  # [Hk, g*ns, nk]
                err.k_signal += (lsig * hf).sum((-1, -2)).double()
                for target, r, e in errors(k_jobs, kb):  # e: [Hk, nk, Nk, D]
                    qr = qsc @ r  # rotate the queries instead of un-rotating the errors
                    for j in range(e.shape[2]):
                        target[j] += ((qr @ e[:, :, j].transpose(1, 2)) ** 2 * hf).sum((-1, -2)).double()
                err.k_count += float(hist.sum())
                p = p * hf
            for target, _, e in errors(v_jobs, vb):
                oe = (p @ e.view(hk, nk, -1)).pow_(2).view(hk, g * ns, -1, d).sum(-1).double().sum(1)  # [Hk, Nv]
                target += oe.T
            err.v_count += g * ns
        return result


def eigvecs_desc(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending) and eigenvectors (columns) of symmetric ``c [..., D, D]`` in float64, signs fixed
    so that each one's largest component is positive."""
    w, u = torch.linalg.eigh(((c + c.transpose(-1, -2)) / 2).double())
    w, u = w.flip(-1), u.flip(-1)
    idx = u.abs().argmax(dim=-2, keepdim=True)
    sign = torch.sign(torch.gather(u, -2, idx))
    sign[sign == 0] = 1
    return w, u * sign


def candidate_rotation(name: str, kind: str, s: LayerStats, center: bool, shared: bool = False) -> torch.Tensor:
    """``[Hk, D, D]`` float32 rotation of candidate ``name`` for ``kind`` "k" or "v". ``shared``: one rotation
    from the layer's pooled moment ``Σ_h w_h c_h / Σ_h w_h`` (equal weights but for the score-weighted target)."""
    hk, d = s.k_sum.shape
    if name == "identity":
        return torch.eye(d).expand(hk, d, d).contiguous()
    if name == "hadamard":
        return hadamard_matrix(d).expand(hk, d, d).contiguous()
    cov = {("k", "oscar"): s.c_q, ("k", "pca-kv"): lambda: s.c_k(center), ("v", "oscar"): lambda: s.c_s(center),
           ("v", "pca-kv"): lambda: s.c_v(center), ("v", "score-weighted"): lambda: s.c_sw(center)}.get((kind, name))
    if cov is None:
        raise ValueError(f"unknown {kind} rotation candidate {name!r}")
    c = cov().cpu()
    if shared:  # the score-weighted target's rows weigh w_t: head h holds sw_w[h] of the pooled weight
        w = s.sw_w.cpu().to(c) if name == "score-weighted" else torch.ones(hk, dtype=c.dtype)  # [Hk]
        c = ((w[:, None, None] * c).sum(0) / w.sum().clamp_min(1e-300)).expand_as(c)
    return oscar_rotation(eigvecs_desc(c)[1]).contiguous()


def center_modes(center) -> list[bool]:
    if center == "auto":
        return [False, True]
    if isinstance(center, bool):
        return [center]
    raise ValueError(f"center must be True, False or 'auto', got {center!r}")


def build_candidates(stats: CalibrationStats, method: str, *, center: bool | str = True, value_target: str = "sst",
                     clip_grid=CLIP_GRID, shared: bool = False) -> tuple[dict[int, LayerCandidates], list, list]:
    """Candidate rotations (and offsets) of every layer, and their names. ``center="auto"``: each candidate twice,
    uncentered and ``"+center"``. Naive INT2 is always evaluated as the report's reference, never selected."""
    if method == "auto":  # (key names, value names) the selection chooses from
        names = list(K_CANDIDATES), list(V_CANDIDATES)
    else:
        names = [method], [("score-weighted" if value_target == "score-weighted" else "oscar") if method == "oscar"
                           else method]
    modes = center_modes(center)
    suffix = (lambda c: "+center" if c else "") if len(modes) > 1 else (lambda c: "")  # noqa: E731
    pairs = [[(n, c) for c in modes for n in kind] for kind in names]  # per kind: (name, centered) in candidate order
    knames, vnames = ([n + suffix(c) for n, c in kind] for kind in pairs)
    grid = torch.tensor(sorted(float(c) for c in clip_grid), dtype=torch.float32)
    out = {}
    for i, s in sorted(stats.layers.items()):
        zero = torch.zeros(s.k_sum.shape)  # [Hk, D]: an uncentered candidate's offset
        rots = [torch.stack([candidate_rotation(n, kind, s, c, shared) for n, c in p]) for kind, p in zip("kv", pairs)]
        mus = [torch.stack([mu.float().cpu() if c else zero for _, c in p]) if any(modes) else None
               for mu, p in zip((s.mu_k, s.mu_v), pairs)]
        out[i] = LayerCandidates(*rots, *mus, grid, grid.clone(), candidate_rotation("identity", "k", s, False)[None])
    return out, knames, vnames


def evaluate_candidates(model, input_ids, candidates: dict[int, LayerCandidates], *, group_size: int = 64,
                        meta_dtype="bfloat16", batch_size: int = 1, pad_id: int = 0, query_samples: int = 128,
                        window: tuple[int, int] | None = None, progress: bool = False,
                        _bar=None) -> dict[int, LayerErrors]:
    """Held-out attention error of every candidate x clip of every layer."""
    meta = META_DTYPES[meta_dtype] if isinstance(meta_dtype, str) else meta_dtype
    seqs = as_sequences(input_ids)
    rec = ErrorRecorder(candidates, group_size, meta, query_samples, window)
    with progress_bar(progress, math.ceil(len(seqs) / batch_size), "OSCAR held-out error", _bar) as bar:
        run_windows(model, rec, seqs, batch_size, pad_id, bar)
    return rec.errors


def select_best(errors: torch.Tensor, shared: bool = False) -> tuple[int, list[int]]:
    """From ``errors [C, N, Hk]``: one clip index for the layer and one candidate per KV head (``shared``: one for
    all), minimizing the summed error; ties prefer the larger clip and the earlier candidate."""
    hk = errors.shape[-1]
    if shared:
        total, arg = errors.sum(-1).min(dim=0)  # [N]: the best candidate's layer error at each clip
    else:
        best, arg = errors.min(dim=0)  # [N, Hk]
        total = best.sum(-1)  # [N]
    j = total.numel() - 1 - int(torch.argmin(total.flip(0)))  # the last minimum: ties prefer the larger clip
    return j, ([int(arg[j])] * hk if shared else [int(a) for a in arg[j]])


def attention_error(model, rotations: OscarRotations, input_ids, *, group_size: int = 64, center: bool = True,
                    meta_dtype="bfloat16", batch_size: int = 1, pad_id: int = 0, query_samples: int = 128,
                    window: tuple[int, int] | None = (64, 256), progress: bool = False) -> dict:
    """The selection's attention error of an artifact on held-out ``input_ids``: per layer the mean squared key-logit
    error ``k``, value output error ``v``, and both relative to the signal; their means over layers ``k_rel``,
    ``v_rel`` and ``total``. ``window=(sink, recent)``: only the pairs the cache quantizes count."""
    rotations.check_compatible(model.config)
    validate_head_dim(rotations.fingerprint, group_size)
    cands = {
        i: LayerCandidates(lr.r_k[None].float(), lr.r_v[None].float(), lr.mu_k if center else None,
                           lr.mu_v if center else None, torch.tensor([lr.clip_k]), torch.tensor([lr.clip_v]))
        for i, lr in rotations.layers.items()}
    errs = evaluate_candidates(
        model, input_ids, cands, group_size=group_size, meta_dtype=meta_dtype, batch_size=batch_size, pad_id=pad_id,
        query_samples=query_samples, window=window, progress=progress)
    per = {i: {"k": float((e.k / max(e.k_count, 1.0)).sum()), "v": float((e.v / max(e.v_count, 1.0)).sum()),
               "k_rel": float(e.k.sum() / e.k_signal.sum()), "v_rel": float(e.v.sum() / e.v_signal.sum())}
           for i, e in sorted(errs.items())}
    k_rel, v_rel = (sum(p[key] for p in per.values()) / max(len(per), 1) for key in ("k_rel", "v_rel"))
    return {"layers": per, "k_rel": k_rel, "v_rel": v_rel, "total": k_rel + v_rel}
