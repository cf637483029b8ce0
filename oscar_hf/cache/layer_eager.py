"""The OSCAR layer's eager side (never compiled): multi-token forwards (their read and bulk writes), ``generate``'s
cache operations, save / load, memory. Layout: :mod:`oscar_hf.cache.layer`."""
from __future__ import annotations

import torch
from torch.compiler import is_compiling

from oscar_hf.kernels.decode import decode
from oscar_hf.kernels.kv import History, Window

from ..patching import base_attention_function
from ..quant import dequantize_rows
from . import heads
from .base import allowed_slots, group_queries, logit_terms, mask_rows
from .window import RowsHistory, commit, demote_pending, ring_entries, ring_slots, sink_from


def _fixed_address(t: torch.Tensor) -> torch.Tensor:
    """Tag a buffer as having a fixed address (CUDA graphs re-use it instead of copying it). Capacity dimensions are
    not marked dynamic (slower to compile): the first growth recompiles once with them symbolic."""
    if not is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


# one decode forward's answer of EagerOps._left_padding_only for its layers: (mask, t_old, answer); the mask
# held so that its id stays unique
_LEFT_PAD_MEMO: list = [None]


def regrown(old: torch.Tensor | None, shape: tuple, dtype: torch.dtype, device, dim: int) -> torch.Tensor:
    """Zeros of ``shape`` at a fixed address, holding ``old``'s entries (if any) along ``dim``, the capacity's, up to
    the smaller of the two sizes."""
    new = torch.zeros(*shape, dtype=dtype, device=device)
    if old is not None:
        k = min(old.shape[dim], new.shape[dim])
        new.narrow(dim, 0, k).copy_(old.narrow(dim, 0, k))
    return _fixed_address(new)


class EagerOps:
    """The OSCAR layer's eager operations (see the module docstring)."""

    def _multi_token(self, query, new_k, new_v, attention_mask, scaling, module, base, t_old, **kwargs):
        b, hq, l, d = query.shape
        hk, cfg, s0, dev = self.num_kv_heads, self.config, self.config.sink, query.device
        g = hq // hk
        t_old = self.host_len - l if t_old is None else t_old
        kv = t_old + l
        if t_old - cfg.recent <= s0:  # nothing quantized yet: exactly the user's attention (as a DynamicCache)
            four_d = attention_mask is not None and attention_mask.dim() == 4
            mask = attention_mask[..., :kv] if four_d else attention_mask
            keys, values = new_k, new_v
            if t_old:  # slots [0, T) from the sink and the ring, in order
                old = self._window_rows(torch.arange(t_old, device=dev), t_old)  # [2, B, Hk, T, D]
                keys, values = torch.cat([old[0], new_k], 2), torch.cat([old[1], new_v], 2)
            out, _ = base_attention_function(module, base)(module, query, keys, values, mask, scaling=scaling, **kwargs)
            self.commit_bulk(new_k, new_v, t_old)
            return out
        # On a non-empty cache: the history up to T - W (the pending demotion first), the window and the new rows
        self._demote_pending(t_old)
        allowed = allowed_slots(attention_mask, b, l, t_old, dev)  # [B, L, kv]
        t = torch.tensor(t_old, device=dev)
        slots = torch.cat([self.pad[:, None] + torch.arange(s0, device=dev)[None, :],  # sink j
                           ring_slots(t, self.ring).clamp(min=0).expand(b, -1)], 1)  # ring entries
        ok = self.window_mask(t, cfg.recent)[:, None, :] & allowed.gather(2, slots.clamp(max=kv - 1)[:, None, :].expand(b, l, -1))
        ok = torch.cat([ok, allowed[:, :, t_old:]], -1)  # [B, L, S0 + R + L]
        q = group_queries(query, hk)  # [B, Hk, g*L, D]
        softcap, sinks = logit_terms(kwargs, hk, l)  # sinks [Hk, g*L] or None
        n = max(t_old - cfg.recent - s0, 0)
        hist_k, hist_v = (h.map(lambda x: x[:, :, :n]) for h in (self.hist_k, self.hist_v))
        win_k, win_v = torch.cat([self.win_k, new_k], 2), torch.cat([self.win_v, new_v], 2)
        prm, q_int2, out_fp = self.params, q.float(), None
        if self.retrieval_heads:  # their coded history [0, n) and the window above, exact: one SDPA call (at 16 bits
            # what a DynamicCache reads) over keys / values [B, P, n + S0 + R + L, D], out_fp [B, P, g*L, D]
            hist_ok = allowed[:, :, s0 : s0 + n] & (torch.arange(n, device=dev)[None, None, :] >= self.pad[:, None, None])
            keys, values = (torch.cat([heads.decode(tuple(x[:, :, :n] for x in c), cfg.retrieval_bits, self.dtype),
                                       w.index_select(1, prm.coded_idx)], 2)
                            for c, w in ((self.coded_k, win_k), (self.coded_v, win_v)))
            ok_fp = mask_rows(torch.cat([hist_ok, ok], -1), g)  # [B, 1, g*L, n + S0 + R + L]
            out_fp = heads.attention(q.index_select(1, prm.coded_idx).to(keys.dtype), keys, values, ok_fp, scaling,
                                     softcap, prm.coded_rows(sinks))
            # the INT2 read below: the other heads only
            q_int2, win_k, win_v = (x.index_select(1, prm.int2_idx) for x in (q_int2, win_k, win_v))
        out = decode(prm.kv(cfg, *self.offsets()), q_int2, Window(win_k, win_v, mask_rows(ok, g)),
                     History(hist_k, hist_v, self.pad, mask_rows(allowed[:, :, s0 : s0 + n], g)), scaling, query.dtype,
                     softcap=softcap, sinks=prm.int2_rows(sinks), use_kernels=cfg.use_kernels)
        if out_fp is not None:
            out = prm.merge(out, out_fp.to(out.dtype))
        self.commit_bulk(new_k, new_v, t_old)
        return out.reshape(query.shape).transpose(1, 2).contiguous()  # [B, L, Hq, D]

    def write(self, new_k: torch.Tensor, new_v: torch.Tensor, pad: torch.Tensor | None = None) -> None:
        """Store ``new_k/v [B, Hk, L, D]`` at slots ``[T, T + L)`` without reading them (rows computed elsewhere:
        a shared prefix); ``pad [B]``: each row's first real slot, taken at the first write (default 0)."""
        self.update(new_k, new_v)
        self.pending = False
        if not self.pad_known:
            if pad is not None:
                self.pad.copy_(pad)
            self.pad_known = True
        t_old = self.host_len - new_k.shape[2]
        self._demote_pending(t_old)
        self.commit_bulk(new_k, new_v, t_old)

    def _history(self) -> RowsHistory:
        """Where this layer's history entries live: index ``slot - S0`` of every row."""
        return RowsHistory(self.hist_k, self.hist_v, self.coded_k, self.coded_v)

    def _demote_pending(self, t: int) -> None:
        """Slot ``t - 1 - W``, which the last decode step left in the window, into the history."""
        demote_pending(self.win_k, self.win_v, self._history(), self.params, self.config, t, self.mu_k_seq)

    def commit_bulk(self, new_k: torch.Tensor, new_v: torch.Tensor, t_old: int) -> None:
        """Write slots ``[T, T + L)``; with ``key_offset="prefill"`` the first demotion fixes the key mean. The cache
        stores values, not autograd graphs (its buffers are written in place)."""
        new_k, new_v = new_k.detach(), new_v.detach()
        s0, w = self.config.sink, self.config.recent
        t_new = t_old + new_k.shape[2]
        b = t_new - w
        if b > max(t_old - w, s0) and t_old == 0 and self.config.key_offset == "prefill" and self.mu_k_seq is None:
            self.mu_k_seq = _fixed_address(self.sequence_key_mean(new_k[:, :, :b]))
        commit(self.win_k, self.win_v, self.pad, self._history(), self.params, self.config, t_old, new_k, new_v,
               self.mu_k_seq)
        self.length.fill_(t_new)

    def _cropped(self, t_new: int) -> None:
        """Before ``crop`` (``HostLength.crop``) moves the length back to ``t_new``: exact up to ``RING_RESERVE``
        tokens; beyond it the window slots that left the ring are refilled from the history."""
        lost = range(max(t_new - self.config.recent - 1, self.config.sink), min(self.host_len - self.ring, t_new))
        if len(lost):  # window slots no longer in the ring: back from the history
            self._refill_ring(lost.start, lost.stop)
        if t_new == 0:
            self.pad_known, self.mu_k_seq = False, None

    def _refill_ring(self, a: int, b: int) -> None:
        """Window slots ``[a, b)`` (``>= S0``) back into their ring entries, dequantized from the history."""
        s0 = self.config.sink
        idx = ring_entries(torch.arange(a, b, device=self.device), s0, self.ring)
        for win, hist, coded, r, mu in ((self.win_k, self.hist_k, self.coded_k, self.params.r_k, self.offsets()[0]),
                                        (self.win_v, self.hist_v, self.coded_v, self.params.r_v, self.offsets()[1])):
            x = None  # [B, H2, b - a, D]
            if self.params.int2_heads:
                rows = dequantize_rows(hist.map(lambda h: h[:, :, a - s0 : b - s0]))  # rotated, centered (own group)
                x = torch.matmul(rows, r.transpose(-1, -2).unsqueeze(0))
                if mu is not None:
                    x = x + (mu[None, :, None, :] if mu.dim() == 2 else mu[:, :, None, :])
            if self.retrieval_heads:  # [B, P, b - a, D] decoded, merged with the INT2 heads' rows into [B, Hk, b - a, D]
                x = self.params.merge(x, heads.decode(tuple(c[:, :, a - s0 : b - s0] for c in coded),
                                                      self.config.retrieval_bits, self.dtype))
            win.index_copy_(2, idx, x.to(self.dtype))

    _BATCH_DIMS = (("win", 1), ("codes", 1), ("meta", 2), ("key_hi", 0), ("value_meta", 1), ("coded_x", 1),
                   ("coded_meta", 2), ("pad", 0), ("mu_k_seq", 0))

    def _rebatched(self) -> None:
        self.batch_size = self.win.shape[1]
        self._bind_step_storage()

    def _left_padding_only(self, attention_mask, t_old: int) -> bool:
        """Whether a decode step's mask hides only each row's left padding, which the decode step reads without a
        mask. One host sync per forward (its first layer)."""
        if attention_mask is None:
            return True
        memo = _LEFT_PAD_MEMO[0]
        if memo is not None and memo[0] is attention_mask and memo[1] == t_old:
            return memo[2]
        allowed = allowed_slots(attention_mask, self.batch_size, 1, t_old, attention_mask.device)[:, 0]  # [B, T + 1]
        ok = torch.equal(allowed, torch.arange(t_old + 1, device=allowed.device)[None, :] >= self.pad[:, None])
        _LEFT_PAD_MEMO[0] = (attention_mask, t_old, ok)
        return ok

    def _window_rows(self, slots: torch.Tensor, t: int) -> torch.Tensor:
        """``[2, B, Hk, n, D]`` (K, V): the rows of ``slots [n]`` from the ring or the sink once slots ``[0, t)`` are
        written; zeros where neither."""
        s0 = self.config.sink
        in_ring = slots >= t - self.ring
        j = slots[None, :] - self.pad[:, None]  # [B, n] sink index of each slot
        in_sink = (j >= 0) & (j < s0)
        ring_e = ring_entries(slots, s0, self.ring)[None, :].expand(self.batch_size, -1)
        src = torch.where(in_ring[None, :], ring_e, j.clamp(0, max(s0 - 1, 0)))
        keep = (in_ring[None, :] | in_sink)[:, None, :, None]
        idx = src[:, None, :, None].expand(-1, self.num_kv_heads, -1, self.head_dim)
        return torch.stack([torch.where(keep, win.gather(2, idx), torch.zeros((), dtype=self.dtype, device=self.device))
                            for win in (self.win_k, self.win_v)])

    def export_state(self) -> dict:
        """The saved form (:mod:`.io`): positions, the sink, the window's slots in order (``tail``), the history's used
        entries and the retrieval heads' every slot."""
        s0, w, t, dev = self.config.sink, self.config.recent, self.host_len, self.device
        self._demote_pending(t)
        ts = t - w if t - w > s0 else 0
        n = max(0, ts - s0)
        tail = self._window_rows(torch.arange(ts, t, device=dev), t)  # [2, B, Hk, t - ts, D]
        state = dict(seq_len=t, tail_start=ts, pad=self.pad.clone(), sink_k=self.win_k[:, :, :s0], sink_v=self.win_v[:, :, :s0],
                     tail_k=tail[0], tail_v=tail[1], hist_k=self.hist_k.map(lambda x: x[:, :, :n]),
                     hist_v=self.hist_v.map(lambda x: x[:, :, :n]), mu_k_seq=self.mu_k_seq)
        if self.retrieval_heads:
            # every slot [0, t) coded: [S0, ts) as stored, the others coded from the window
            front = self._window_rows(torch.arange(min(s0, ts), device=dev), t)  # [2, B, Hk, min(S0, ts), D]
            for i, (kind, coded) in enumerate((("k", self.coded_k), ("v", self.coded_v))):
                parts = zip(self.params.encode_coded(front[i]), (x[:, :, :n] for x in coded),
                            self.params.encode_coded(tail[i]))
                state[f"fp_{kind}"] = tuple(torch.cat(p, 2) for p in parts)  # [B, P, t, *]
        return state

    def import_state(self, state: dict) -> None:
        """Load :meth:`export_state`'s form, the tail from ``buf_slot0`` (tensors on this layer's device, shapes
        checked by :mod:`.io`). A sink may be saved partly filled: entries still in the tail come from there."""
        s0, t, ts, bs0 = self.config.sink, int(state["seq_len"]), int(state["tail_start"]), int(state["buf_slot0"])
        tails = [state[k][:, :, ts - bs0 :] for k in ("tail_k", "tail_v")]  # slots [ts, t)
        self.host_len = 0
        self.lazy_initialization(tails[0][:, :, :0], tails[1][:, :, :0])
        self.advance(t)
        self.pad.copy_(state["pad"])
        self.pad_known = True
        idx = ring_entries(torch.arange(max(ts, t - self.ring), t, device=self.device), s0, self.ring)
        for win, sink, tail in zip((self.win_k, self.win_v), (state["sink_k"], state["sink_v"]), tails):
            win[:, :, :s0] = sink_from(sink, tail, state["pad"], ts)
            win.index_copy_(2, idx, tail[:, :, tail.shape[2] - idx.shape[0] :])
        history = self._history()
        for kind in ("k", "v"):  # entries [0, ts - S0); the retrieval heads': slots [S0, ts) of the every-slot form
            coded = tuple(x[:, :, s0 : max(s0, ts)] for x in state[f"fp_{kind}"]) if self.retrieval_heads else None
            history.write(kind, 0, coded, state[f"hist_{kind}"])
        if state.get("mu_k_seq") is not None:
            self.mu_k_seq = _fixed_address(state["mu_k_seq"].float().contiguous())
        if ts > s0:  # the ring also holds the slot before the window (a decode step re-demotes it): from its codes
            self._refill_ring(ts - 1, ts)
        self.length.fill_(t)

    def memory(self) -> dict[str, int]:
        """Bytes of the cached tokens (the retrieval heads' coded rows: history entries only) and allocated."""
        if not self.is_initialized:
            return dict(sink=0, recent=0, history_codes=0, history_meta=0, history_elements=0, retrieval_heads=0,
                        allocated=0, tokens=0)
        cfg, s0, hk, d = self.config, self.config.sink, self.num_kv_heads, self.head_dim
        t = torch.tensor(self.host_len, device=self.device)
        mask = self.window_mask(t, cfg.recent)
        n_sink, n_rec = int(mask[:, :s0].sum()), int(mask[:, s0:].sum())  # summed over rows
        n_hist = int((self.n_hist(t) - self.pad).clamp(min=0).sum())
        hq, el, meta_el = len(self.params.int2_heads), self.dtype.itemsize, cfg.torch_meta_dtype.itemsize
        bufs = [x for x in (self.win, self.codes, self.meta, self.key_hi, self.value_meta, self.coded_x,
                            self.coded_meta) if x is not None]
        # (3-bit keys: one more bit a key element, the plane key_hi)
        code_bits = cfg.key_bits + cfg.bits
        return dict(
            sink=2 * n_sink * hk * d * el, recent=2 * n_rec * hk * d * el,
            history_codes=code_bits * n_hist * hq * d // 8,
            history_meta=n_hist * hq * (d // cfg.group_size + d // cfg.value_group(d)) * 2 * meta_el,
            history_elements=2 * n_hist * hq * d,
            # the coded history entries of those heads (their window copies, if any, are counted above)
            retrieval_heads=2 * n_hist * len(self.retrieval_heads) * heads.row_bytes(cfg.retrieval_bits, d, self.dtype),
            allocated=sum(x.numel() * x.element_size() for x in bufs), tokens=n_sink + n_rec + n_hist)
