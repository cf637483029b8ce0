"""`OscarLayer`: the eager quantized layer (sink + recent window in the model dtype, packed INT2 rotated history) and
its read. Slots are absolute positions ``0 <= s < T``, row ``b``'s first real one ``pad[b]``; the parts (tail, sink,
history, retrieval heads), their shapes and the life of a forward: docs/cache.md, "The eager layer".
"""
from __future__ import annotations

import logging

import torch

from oscar_hf.kernels.heads_attention import heads_decode_attention
from oscar_hf.kernels.kv import History, Window

from ..attention import OscarKV
from ..config import OscarConfig
from ..patching import base_attention_function
from ..quant import QuantizedRows
from ..rotations import LayerRotation
from . import heads
from .base import QuantizedLayerBase, allowed_slots, first_real_slot, group_queries, logit_terms, mask_rows
from .dynamic_write import CROP_RESERVE, TAIL_SLACK, DynamicWrites, grown

logger = logging.getLogger("oscar_hf")

# one forward's answer of _left_padding_only for its layers: (mask, t_old, answer); the mask held so its id stays unique
_LEFT_PAD_MEMO: list = [None]


def _left_padding_only(attention_mask, allowed: torch.Tensor, t_old: int) -> bool:
    """Whether a decode step's mask (``allowed [B, 1, kv]``) only hides a left-padding prefix of each row: then a
    per-row start replaces the history's key mask (the Gluon history kernel has none). One host sync per forward,
    none while compiling or capturing a CUDA graph."""
    if torch.compiler.is_compiling() or (allowed.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    memo = _LEFT_PAD_MEMO[0]
    if memo is not None and memo[0] is attention_mask and memo[1] == t_old:
        return memo[2]
    row = allowed[:, -1, :]
    ok = bool((row[:, 1:] >= row[:, :-1]).all())
    _LEFT_PAD_MEMO[0] = (attention_mask, t_old, ok)
    return ok


class OscarLayer(DynamicWrites, QuantizedLayerBase):
    """One quantized decoder layer's eager cache (layout: the module docstring)."""

    is_compileable = False

    def __init__(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, retrieval_heads=()):
        super().__init__(config, rotation, layer_idx, retrieval_heads)
        OscarLayer.reset(self)  # (not self.reset: a hybrid layer's also resets its state, not built yet)

    def reset(self) -> None:
        self.is_initialized = False
        self.params = None
        self.pad: torch.Tensor | None = None  # [B] first real slot per row
        self.pad_max = self.seq_len = self.tail_start = self.buf_slot0 = 0  # seq_len: T, the committed slots
        self.tail_k = self.tail_v = self.sink_k = self.sink_v = self.hist_k = self.hist_v = self.mu_k_seq = None
        self.pending: OscarKV | None = None  # what update returned, until attend commits it
        self.fp_k = self.fp_v = None  # every slot of the retrieval heads: tuples of [B, P, cap, *] (heads.py)
        self._fp_written = False  # this forward's new rows are already in fp_k/v

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.params = self.build_params(key_states)
        b, hk, _, d = key_states.shape
        s0, g, meta = self.config.sink, self.config.group_size, self.config.torch_meta_dtype
        kw = dict(dtype=self.dtype, device=self.device)
        cap = self.config.recent + CROP_RESERVE + TAIL_SLACK
        self.tail_k, self.tail_v = (torch.zeros(b, hk, cap, d, **kw) for _ in range(2))
        self.sink_k, self.sink_v = (torch.zeros(b, hk, s0, d, **kw) for _ in range(2))
        h2 = len(self.params.int2_heads)  # empty histories [B, H2, 0, *], grown as slots are demoted
        self.hist_k, self.hist_v = (QuantizedRows(torch.zeros(b, h2, 0, d // 4, dtype=torch.uint8, device=self.device),
                                                  *(torch.zeros(b, h2, 0, d // g, dtype=meta, device=self.device)
                                                    for _ in range(2))) for _ in range(2))
        if self.retrieval_heads:  # no slot yet: [B, P, 0, *] each, grown by write_retrieval_heads
            p, specs = len(self.retrieval_heads), heads.part_specs(self.config.retrieval_bits, d, self.dtype)
            self.fp_k, self.fp_v = (tuple(torch.zeros(b, p, 0, x, dtype=dt, device=self.device) for x, dt in specs)
                                    for _ in range(2))
        self.is_initialized = True

    def write_retrieval_heads(self, new_k: torch.Tensor, new_v: torch.Tensor, t_old: int) -> None:
        """Slots ``[t_old, t_old + L)`` of the retrieval heads, once per forward (before they are read)."""
        if not self.retrieval_heads or self._fp_written:
            return
        t_new = t_old + new_k.shape[2]
        self.fp_k = tuple(grown(t, t_old, t_new) for t in self.fp_k)
        self.fp_v = tuple(grown(t, t_old, t_new) for t in self.fp_v)
        for store, new in ((self.fp_k, new_k), (self.fp_v, new_v)):
            for dst, src in zip(store, heads.encode(new.index_select(1, self.params.coded_idx),
                                                    self.config.retrieval_bits)):
                dst[:, :, t_old:t_new] = src
        self._fp_written = True

    def retrieval_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v) [B, P, n, D]``: slots ``[0, n)`` of the retrieval heads in the model dtype."""
        bits = self.config.retrieval_bits
        return tuple(heads.decode(tuple(t[:, :, :n] for t in store), bits, self.dtype)
                     for store in (self.fp_k, self.fp_v))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise RuntimeError(
                f"OscarCache layer {self.layer_idx}: update() was called again before the previous rows were consumed "
                "by the 'oscar_*' attention function. The model's attention does not go through OSCAR: build the "
                "cache with OscarCache(model, ...) / OscarCache.from_pretrained(path, model), or call "
                "oscar_hf.enable_oscar(model).")
        self.check_update(key_states)
        self.pending = OscarKV(self, key_states, value_states)
        self._fp_written = False  # (a forward that failed after writing its full-precision rows left it set)
        return self.pending, self.pending

    def get_seq_length(self) -> int:
        return self.seq_len + (self.pending.key_states.shape[-2] if self.pending is not None else 0)

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.seq_len + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def attend(self, handle: OscarKV, query, attention_mask, scaling: float, module, base: str, **kwargs) -> torch.Tensor:
        """``query [B, Hq, L, D]`` -> ``[B, L, Hq, D]`` over the cache and the new rows, then commits them."""
        new_k, new_v = handle.key_states, handle.value_states
        b, hq, l, d = query.shape
        hk = new_k.shape[1]
        g = hq // hk
        t_old = self.seq_len
        kv = t_old + l
        allowed = allowed_slots(attention_mask, b, l, kv, t_old)
        pad = first_real_slot(allowed, b, query.device) if self.pad is None else None
        if self.tail_start == 0:
            # Nothing quantized yet: exactly what DynamicCache + the user's attention would compute.
            tk, tv = self.tail_view()
            keys = torch.cat([tk, new_k], 2) if tk.shape[2] else new_k
            values = torch.cat([tv, new_v], 2) if tv.shape[2] else new_v
            out, _ = base_attention_function(module, base)(module, query, keys, values, attention_mask, scaling=scaling, **kwargs)
            self.commit(new_k, new_v, pad)
            return out
        q = group_queries(query, hk)  # [B, Hk, M, D], M = g*L
        softcap, sinks = logit_terms(kwargs, hk, l)  # sinks [Hk, M] or None
        s0 = self.config.sink
        dev = query.device
        # 1. full-precision window: sink + recent tail + the new rows (S0 + W + L slots at most)
        tk, tv = self.tail_view()
        win_k = torch.cat([self.sink_k, tk, new_k], 2)  # [B, Hk, S0 + (T - tail_start) + L, D]
        win_v = torch.cat([self.sink_v, tv, new_v], 2)
        sinks_full = allowed is None and self.tail_start >= self.pad_max + s0
        ok = None  # [B, L, window] bool, None when every window slot is valid for every row
        if sinks_full and l == 1:
            win_mask = None  # decode without padding: every window slot is valid (the common fast case)
        else:
            sink_slot = self.pad[:, None] + torch.arange(s0, device=dev)[None, :]  # [B, S0]
            sink_ok = (torch.arange(s0, device=dev)[None, :] < self.sink_count()[:, None])[:, None, :].expand(b, l, s0)
            if allowed is not None:
                sink_ok = sink_ok & allowed.gather(2, sink_slot.clamp(max=kv - 1)[:, None, :].expand(b, l, s0))
                tail_ok = allowed[:, :, self.tail_start :]
            else:  # causal among the new rows
                tail_ok = torch.arange(self.tail_start, kv, device=dev)[None, :] <= (t_old + torch.arange(l, device=dev))[:, None]
                tail_ok = tail_ok[None].expand(b, l, -1)
            ok = torch.cat([sink_ok, tail_ok], -1)  # [B, L, window]
            win_mask = ok[:, None] if l == 1 else mask_rows(ok, g)  # [B, 1, 1|M, window]
        # 2. the history's bounds: entry j of row b is slot s0 + j; entries below pad[b] are sink or padding
        n = self.n_hist
        key_mask = None  # None when a per-row start says all the mask says
        hist_start = self.pad
        if allowed is not None:
            if l == 1 and _left_padding_only(attention_mask, allowed, t_old):
                # the mask's padding prefix as a later start, not a key mask (same entries; on the GPU the Gluon kernel)
                hist_start = torch.maximum(self.pad, first_real_slot(allowed, b, dev) - s0)
            else:
                hm = allowed[:, :, s0 : s0 + n]
                key_mask = hm[:, None] if l == 1 else mask_rows(hm, g)
        out_fp = None
        if self.retrieval_heads:  # retrieval heads apart; the rest reads window + INT2 history below
            self.write_retrieval_heads(new_k, new_v, t_old)
            if l == 1 and key_mask is None:  # a decode step: their codes read in place
                out_fp = heads_decode_attention(
                    q, self.params.coded_idx, (self.fp_k, self.fp_v), self.params.bits,
                    (s0 + hist_start, self.tail_start), Window(win_k, win_v, None if ok is None else ok[:, 0]),
                    scaling, query.dtype, use_kernels=self.config.use_kernels, softcap=softcap,
                    sinks=self.params.coded_rows(sinks))
            else:  # their history slots [S0, tail_start) (from S0 + pad[b]) and the window
                hist_ok = (torch.arange(n, device=dev)[None, :] >= self.pad[:, None])[:, None, :].expand(b, l, n)
                if allowed is not None:
                    hist_ok = hist_ok & allowed[:, :, s0 : s0 + n]
                win_ok = ok if ok is not None else hist_ok.new_ones(b, l, win_k.shape[2])
                hist_k, hist_v = (x[:, :, s0:] for x in self.retrieval_kv(s0 + n))  # [B, P, n, D]
                out_fp = self.retrieval_read(q, hist_k, hist_v, win_k, win_v, torch.cat([hist_ok, win_ok], -1), scaling,
                                             softcap, sinks)
        # 1 + 3 merged by log-sum-exp (the INT2 history in the rotated space, the query rotated inside)
        out = self.read(q.float(), Window(win_k, win_v, win_mask), History(*self.hist_view(), hist_start, key_mask), scaling,
                        query.shape, query.dtype, softcap, sinks, out_fp)
        self.commit(new_k, new_v, pad)
        return out

    @property
    def n_hist(self) -> int:
        """History entries stored (shared index space); row b reads [pad[b], n_hist)."""
        return max(0, self.tail_start - self.config.sink)

    def sink_count(self) -> torch.Tensor:
        """``[B]`` valid sink entries per row."""
        return (self.tail_start - self.pad).clamp(0, self.config.sink)

    def tail_view(self):
        """Full-precision slots ``[tail_start, T)``: ``(k, v)`` views ``[B, Hk, T - tail_start, D]``."""
        a, b = self.tail_start - self.buf_slot0, self.seq_len - self.buf_slot0
        return self.tail_k[:, :, a:b], self.tail_v[:, :, a:b]

    def hist_view(self):
        n = self.n_hist
        cut = lambda q: QuantizedRows(*(t[:, :, :n] for t in q))  # noqa: E731
        return cut(self.hist_k), cut(self.hist_v)

    def export_state(self) -> dict:
        """The saved form (:mod:`.io`): positions and the used part of each buffer; the rollback reserve
        ``[buf_slot0, tail_start)`` is not saved (a loaded cache starts without one)."""
        hist_k, hist_v = self.hist_view()
        tail_k, tail_v = self.tail_view()
        st = dict(seq_len=self.seq_len, tail_start=self.tail_start, pad=self.pad, sink_k=self.sink_k,
                  sink_v=self.sink_v, tail_k=tail_k, tail_v=tail_v, hist_k=hist_k, hist_v=hist_v, mu_k_seq=self.mu_k_seq)
        if self.retrieval_heads:
            st["fp_k"], st["fp_v"] = (tuple(x[:, :, : self.seq_len] for x in store) for store in (self.fp_k, self.fp_v))
        return st

    def import_state(self, st: dict) -> None:
        """Load the saved form, the tail from slot ``buf_slot0`` (tensors on this layer's device, shapes checked by
        :mod:`.io`)."""
        seq, bs0 = st["seq_len"], st["buf_slot0"]
        self.lazy_initialization(st["tail_k"][:, :, :0], st["tail_v"][:, :, :0])
        self._set_pad(st["pad"])
        self.sink_k, self.sink_v, self.hist_k, self.hist_v = st["sink_k"], st["sink_v"], st["hist_k"], st["hist_v"]
        cap = max(seq - bs0 + TAIL_SLACK, self.config.recent + CROP_RESERVE + TAIL_SLACK)
        self.tail_k, self.tail_v = (grown(st[k], seq - bs0, cap, exact=True) for k in ("tail_k", "tail_v"))
        self.seq_len, self.tail_start, self.buf_slot0 = seq, st["tail_start"], bs0
        if st.get("fp_k") is not None:
            self.fp_k, self.fp_v = st["fp_k"], st["fp_v"]
        self.mu_k_seq = st["mu_k_seq"]

    def memory(self) -> dict[str, int]:
        """Bytes actually used by the cached tokens (logical) and allocated by the buffers."""
        if not self.is_initialized:
            return dict(self.EMPTY_MEMORY)
        n_sink = int(self.sink_count().sum()) if self.pad is not None else 0
        n_rec = (self.seq_len - self.tail_start) * self.batch_size
        n_hist = int((self.n_hist - self.pad.clamp(max=self.n_hist)).sum()) if self.pad is not None else 0
        n_real = int((self.seq_len - self.pad.clamp(max=self.seq_len)).sum()) if self.pad is not None else 0
        bufs = [self.tail_k, self.tail_v, self.sink_k, self.sink_v, *self.hist_k, *self.hist_v, *(self.fp_k or ()),
                *(self.fp_v or ())]
        return self.memory_from_counts(n_sink, n_rec, n_hist, n_real, bufs)
