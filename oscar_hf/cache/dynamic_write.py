"""The eager layer's writes: new rows into the tail, slots leaving the recent window demoted into the sink and the
INT2 history, and ``generate``'s cache operations. Layout: :mod:`oscar_hf.cache.dynamic`."""
from __future__ import annotations

import logging

import torch

from oscar_hf.kernels.write_path import rotate_quantize

from ..quant import QuantizedRows
from .window import sink_from

logger = logging.getLogger("oscar_hf")

CROP_RESERVE = 64  # demoted slots kept in full precision so that crop(-n) can undo a demotion exactly
TAIL_SLACK = 64  # extra tail capacity so that compaction happens once every TAIL_SLACK appends


def grown(t: torch.Tensor, keep: int, need: int, exact: bool = False) -> torch.Tensor:
    """``t [B, H, cap, X]`` with room for ``need`` entries along dim 2 (amortized x1.5 unless ``exact``), its first
    ``keep`` kept."""
    cap = t.shape[2]
    if need <= cap:
        return t
    z = t.new_zeros(*t.shape[:2], need if exact else max(need, int(cap * 1.5), 1024), t.shape[3])
    z[:, :, :keep] = t[:, :, :keep]
    return z


class DynamicWrites:
    """The writes and cache operations of an eager layer (see the module docstring)."""

    def commit(self, new_k: torch.Tensor, new_v: torch.Tensor, pad: torch.Tensor | None = None) -> None:
        """Append ``new_k/v [B, Hk, L, D]`` (slots ``[T, T + L)``) and demote what left the recent window."""
        if not self.is_initialized:
            self.lazy_initialization(new_k, new_v)
        self.pending = None
        self.write_retrieval_heads(new_k, new_v, self.seq_len)
        self._fp_written = False
        if self.pad is None:
            self._set_pad((pad if pad is not None else torch.zeros(self.batch_size, dtype=torch.long)).to(self.device))
        t_old, n_new = self.seq_len, new_k.shape[-2]
        t_new = t_old + n_new
        target = max(self._recent_start(t_new), self.tail_start)
        if target > self.tail_start:
            self._demote(self.tail_start, target, t_old, new_k, new_v)
        # Append the new rows that stay in full precision, plus the rollback reserve.
        self._append(new_k, new_v, t_old, t_new, target)
        self.tail_start = target
        self.seq_len = t_new

    def _set_pad(self, pad: torch.Tensor) -> None:
        """``pad [B]``, each row's first real slot, and its maximum on the host."""
        self.pad, self.pad_max = pad, int(pad.max()) if pad.numel() else 0

    def _recent_start(self, t: int) -> int:
        """First recent slot at ``t`` slots; 0 (the tail holds all) until some row has a history token."""
        s0, w = self.config.sink, self.config.recent
        return t - w if t - w > s0 else 0

    def _source(self, a: int, b: int, t_old: int, new_k, new_v):
        """``(k, v) [B, H, b - a, D]``: slots ``[a, b)`` from the old tail (``< t_old``) and/or the new rows; views
        when one source serves."""
        parts = []  # (k, v) of the old tail, then of the new rows
        if a < t_old:
            pa, pb = a - self.buf_slot0, min(b, t_old) - self.buf_slot0
            parts.append((self.tail_k[:, :, pa:pb], self.tail_v[:, :, pa:pb]))
        if b > t_old:
            na, nb = max(a, t_old) - t_old, b - t_old
            parts.append((new_k[:, :, na:nb], new_v[:, :, na:nb]))
        return parts[0] if len(parts) == 1 else tuple(torch.cat(x, 2) for x in zip(*parts))

    def _demote(self, a: int, b: int, t_old: int, new_k, new_v) -> None:
        s0 = self.config.sink
        # Sink: rows whose first S0 real slots intersect [a, b) copy them in (per-row gather).
        if a < self.pad_max + s0:  # (no sink slot at or past pad_max + S0)
            src_k, src_v = self._source(a, min(b, self.pad_max + s0), t_old, new_k, new_v)
            self.sink_k, self.sink_v = sink_from(self.sink_k, src_k, self.pad, a), sink_from(self.sink_v, src_v, self.pad, a)
        # History: slots [max(a, S0), b) -> indices [.. - S0], every row (masked per row on read).
        ha = max(a, s0)
        if b <= ha:
            return
        self._reserve_hist(b - s0)
        if self.config.key_offset == "prefill" and self.mu_k_seq is None:
            self.mu_k_seq = self.sequence_key_mean(self._source(0, b, t_old, new_k, new_v)[0])
        cfg, prm = self.config, self.params
        for c0 in range(ha, b, cfg.prefill_chunk):
            parts = zip(self._source(c0, min(b, c0 + cfg.prefill_chunk), t_old, new_k, new_v), prm.r, self.offsets(),
                        (prm.clip_k, prm.clip_v), (self.hist_k, self.hist_v))
            for x, r, mu, clip, out in parts:  # keys, then values
                rotate_quantize(prm.int2_part(x), r, mu, clip, cfg.group_size, cfg.torch_meta_dtype, out=out,
                                out_offset=c0 - s0, use_kernels=cfg.use_kernels, quantizer=cfg.quantizer)

    def _reserve_hist(self, n: int) -> None:
        cap = self.hist_k.codes.shape[2]
        self.hist_k, self.hist_v = (QuantizedRows(*(grown(t, cap, n) for t in q)) for q in (self.hist_k, self.hist_v))

    def _append(self, new_k, new_v, t_old: int, t_new: int, target: int) -> None:
        """Write slots ``[first, t_new)`` (up to ``CROP_RESERVE`` demoted ones too) into the tail, compacting or
        growing it when full (at most ``recent + CROP_RESERVE`` rows once every ``TAIL_SLACK`` steps)."""
        first = max(t_old, target - CROP_RESERVE)
        keep_from = max(self.buf_slot0, target - CROP_RESERVE)  # oldest slot worth keeping
        cap = self.tail_k.shape[2]
        if t_new - self.buf_slot0 > cap or keep_from > t_old:
            need = t_new - keep_from + TAIL_SLACK
            n_keep = max(0, t_old - keep_from)
            a = keep_from - self.buf_slot0
            old = [t[:, :, a : a + n_keep].clone() for t in (self.tail_k, self.tail_v)]
            if need > cap:
                self.tail_k, self.tail_v = (t.new_zeros(*t.shape[:2], need, self.head_dim) for t in old)
            self.tail_k[:, :, :n_keep], self.tail_v[:, :, :n_keep] = old
            self.buf_slot0 = keep_from
        p = first - self.buf_slot0
        self.tail_k[:, :, p : p + t_new - first] = new_k[:, :, first - t_old :]
        self.tail_v[:, :, p : p + t_new - first] = new_v[:, :, first - t_old :]

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens: exact within the rollback reserve; beyond it the recent
        window refills as decoding goes on."""
        n = self._tokens_to_crop(tokens_to_remove)
        if self.pending is not None:
            raise RuntimeError("crop() during a forward pass")
        if n == 0:
            return
        t_new = max(0, self.seq_len - n)
        want = self._recent_start(t_new)  # where the tail would start had we decoded to t_new
        # Undo demotions as far as the reserve allows (slots >= buf_slot0 are still in full precision).
        self.tail_start = min(max(want, self.buf_slot0), self.tail_start, t_new)
        if t_new < self.buf_slot0:
            self.buf_slot0 = self.tail_start = t_new
        self.seq_len = t_new
        if self.tail_start > want:
            logger.debug("layer %d: crop beyond the rollback reserve; recent window refills as decoding goes on", self.layer_idx)

    def _batch_apply(self, fn, in_place: bool) -> None:  # (buffers replaced either way)
        if not self.is_initialized:
            return
        self.tail_k, self.tail_v, self.sink_k, self.sink_v = map(fn, (self.tail_k, self.tail_v, self.sink_k, self.sink_v))
        self.hist_k, self.hist_v = (QuantizedRows(*map(fn, h)) for h in (self.hist_k, self.hist_v))
        if self.fp_k is not None:
            self.fp_k, self.fp_v = (tuple(map(fn, store)) for store in (self.fp_k, self.fp_v))
        if self.pad is not None:
            self._set_pad(fn(self.pad))
        if self.mu_k_seq is not None:
            self.mu_k_seq = fn(self.mu_k_seq)
        self.batch_size = self.tail_k.shape[0]
