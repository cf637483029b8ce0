"""`OscarLayer`: one quantized layer of :class:`~oscar_hf.OscarCache`: BF16 sink + BF16 recent window + packed INT2
rotated history, and its read.

Storage of one layer, for a batch of ``B`` rows, ``Hk`` KV heads:

* slots are absolute positions in the (left-padded) batch, ``0 <= s < T``; row ``b``'s first real
  token is at slot ``pad[b]`` (read from the attention mask at the first forward);
* **tail** (``tail_k/v [B, Hk, cap, D]``, model dtype): slots ``[tail_start, T)``: the last
  ``recent`` tokens (and, while nothing is quantized yet, everything). Slot ``s`` lives at
  physical index ``s - buf_slot0``; slots ``[buf_slot0, tail_start)`` were already demoted but are
  kept as a small rollback reserve so that ``crop`` (assisted decoding) is exact;
* **sink** (``sink_k/v [B, Hk, S0, D]``): row ``b``'s first ``S0`` real tokens, slots
  ``pad[b] + j``, gathered per row when demoted (rows of different padding demote at their own pace);
* **history** (``QuantizedRows`` of ``[B, Hq, cap_h, ...]``): slot ``S0 + j`` at index ``j`` for
  every row, rotated/centered/clipped INT2; row ``b`` reads ``pad[b] <= j < tail_start - S0``
  (indices below ``pad[b]`` hold that row's padding or sink tokens and are never read).
  ``Hq = Hk`` unless the layer has **full-precision heads** (``OscarConfig.full_precision_heads``,
  e.g. the retrieval heads): those ``P`` heads are left out of the INT2 history and instead keep every
  slot ``[0, T)`` in ``fp_k/v`` (``[B, P, cap, *]`` tensors: the model dtype or INT8/INT4 codes with a scale and zero
  per token and head, ``OscarConfig.full_precision_bits``, :mod:`oscar_hf.cache.heads`), read like a ``DynamicCache``.

So every slot of row ``b`` is in exactly one part: pad ``[0, pad_b)``, sink ``[pad_b, min(tail_start,
pad_b + S0))``, history ``[pad_b + S0, tail_start)``, recent ``[tail_start, T)``; per-row counts are
derived from ``tail_start`` and ``pad`` (no per-row counters to keep in sync).

Life of a forward: ``update(k, v)`` only parks the new rows and returns an :class:`OscarKV`
handle; the registered attention function (``oscar_hf.attention``) hands the call to
:meth:`OscarLayer.attend`, which reads the cache as it was *before* this forward plus the new rows
in full precision (prefill is exact), then calls :meth:`OscarLayer.commit`, which demotes
everything older than the last ``recent`` slots (bulk, in ``prefill_chunk`` pieces, at prefill;
one row per step while decoding) and appends the remaining new rows to the tail. A long prompt therefore never has its history held in full
precision inside the cache.

The read (:meth:`OscarLayer.attend`). For one layer and a forward of ``L`` new tokens at slots ``[T, T + L)``:

* nothing quantized yet (``tail_start == 0``): the tail holds every slot in order, so the base
  implementation runs on ``cat(tail, new)`` with the model's own mask: bit-identical to a
  ``DynamicCache`` (prompts shorter than ``sink + recent``);
* otherwise three online-softmax partials, merged by log-sum-exp:
  1. full precision: sink (row ``b``'s slots ``pad[b] + j``), recent tail ``[tail_start, T)``
     and the new rows (causal among themselves);
  2. INT2 history ``[S0 + pad[b], tail_start)``: ``q`` is rotated once by ``R_K``
     (``q·k = (q R_K)·(k R_K)``), logits get ``+ q·mu_K``; the values are accumulated in the
     rotated space, rotated back once by ``R_Vᵀ`` and get ``+ (Σ_history p)·mu_V``. The history
     is read in bounded blocks (torch reference) or by the split-K Triton kernel (CUDA): no
     full-precision copy of it is ever built;
* full-precision heads (``OscarConfig.full_precision_heads``): those KV heads keep every slot in
  ``layer.fp_k/v`` (INT8 by default) and read their history range from it and the window of part 1, one SDPA
  call (:meth:`OscarLayer.full_precision_heads_attention`; at 16 bits what a ``DynamicCache`` reads); the two
  parts above run on the other heads only;
* then :meth:`OscarLayer.commit` demotes/appends.

The attention mask (left padding, holes, custom 4D masks) is honoured in all three parts by
indexing it at each part's absolute slots.
"""
from __future__ import annotations

import logging

import torch

from oscar_hf.kernels.heads_attention import heads_decode_attention
from oscar_hf.kernels.int2_attention import decode_attention_rotating
from oscar_hf.kernels.write_path import rotate_quantize

from ..attention import OscarKV
from ..config import OscarConfig
from ..patching import base_attention_function
from ..quant import QuantizedRows
from ..rotations import LayerRotation
from . import heads
from .base import QuantizedLayerBase, allowed_slots, first_real_slot, group_queries, logit_terms, mask_rows

logger = logging.getLogger("oscar_hf")

CROP_RESERVE = 64  # demoted slots kept in full precision so that crop(-n) can undo a demotion exactly
TAIL_SLACK = 64  # extra tail capacity so that compaction happens once every TAIL_SLACK appends


def grown(t: torch.Tensor, keep: int, need: int) -> torch.Tensor:
    """``t [B, H, cap, X]`` with room for at least ``need`` entries along dim 2 (amortized growth: never an O(n)
    copy per step); its first ``keep`` entries are kept. ``t`` itself when it is large enough."""
    cap = t.shape[2]
    if need <= cap:
        return t
    z = t.new_zeros(*t.shape[:2], max(need, int(cap * 1.5), 1024), t.shape[3])
    z[:, :, :keep] = t[:, :, :keep]
    return z


def slot_rows(tail_k, tail_v, tail_slot0: int, t_old: int, a: int, b: int, new_k, new_v):
    """``(k, v) [B, H, b - a, D]``: the rows of slots ``[a, b)`` from a full-precision tail whose index 0 is slot
    ``tail_slot0`` (slots ``< t_old``) and/or the new rows (slots ``>= t_old``); views when one source serves."""
    parts_k, parts_v = [], []
    if a < t_old:
        pa, pb = a - tail_slot0, min(b, t_old) - tail_slot0
        parts_k.append(tail_k[:, :, pa:pb])
        parts_v.append(tail_v[:, :, pa:pb])
    if b > t_old:
        na, nb = max(a, t_old) - t_old, b - t_old
        parts_k.append(new_k[:, :, na:nb])
        parts_v.append(new_v[:, :, na:nb])
    if len(parts_k) == 1:
        return parts_k[0], parts_v[0]
    return torch.cat(parts_k, 2), torch.cat(parts_v, 2)


# one forward's answer of _left_padding_only, shared by its layers: (mask, t_old, answer); the mask held so that its id
# cannot be reused while the entry lives
_LEFT_PAD_MEMO: list = [None]


def _left_padding_only(attention_mask, allowed: torch.Tensor, t_old: int) -> bool:
    """Whether a decode step's mask (``allowed [B, 1, kv]``) only hides a left-padding prefix of each row (every row
    False...False True...True). Then the history's key mask says no more than a per-row start (its first allowed
    slot), which the decode op takes without a mask -- and so can run on the Gluon history kernel, which has none.
    One host sync per forward: the answer is kept for the other layers given the same mask (a layer with another
    mask, e.g. a sliding window, gets its own); none while compiling or capturing a CUDA graph (the mask is kept)."""
    if torch.compiler.is_compiling() or (allowed.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    memo = _LEFT_PAD_MEMO[0]
    if memo is not None and memo[0] is attention_mask and memo[1] == t_old:
        return memo[2]
    row = allowed[:, -1, :]
    ok = bool((row[:, 1:] >= row[:, :-1]).all())
    _LEFT_PAD_MEMO[0] = (attention_mask, t_old, ok)
    return ok


class OscarLayer(QuantizedLayerBase):
    """One quantized decoder layer's cache (see the module docstring for the layout)."""

    is_compileable = False
    is_croppable = True

    def __init__(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, fp_heads=()):
        super().__init__(config, rotation, layer_idx, fp_heads)
        self._clear()

    # ------------------------------------------------------------------ state
    def _clear(self):
        self.is_initialized = False
        self.keys = self.values = None  # CacheLayerMixin attributes; unused (no full-precision copy)
        self.params = None
        self.pad: torch.Tensor | None = None  # [B] first real slot per row
        self.pad_max = 0
        self.seq_len = 0  # T: committed slots
        self.tail_start = 0
        self.buf_slot0 = 0
        self.tail_k = self.tail_v = None
        self.sink_k = self.sink_v = None
        self.hist_k: QuantizedRows | None = None
        self.hist_v: QuantizedRows | None = None
        self.mu_k_seq = None
        self.pending: OscarKV | None = None
        self.fp_k = self.fp_v = None  # every slot of the full-precision heads: tuples of [B, P, cap, *] (heads.py)
        self._fp_written = False  # this forward's new rows are already in fp_k/v

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.params = self.build_params(key_states)
        b, hk, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_kv_heads, self.head_dim = b, hk, d
        s0, g, meta = self.config.sink, self.config.group_size, self.config.torch_meta_dtype
        kw = dict(dtype=self.dtype, device=self.device)
        cap = self.config.recent + CROP_RESERVE + TAIL_SLACK
        self.tail_k = torch.zeros(b, hk, cap, d, **kw)
        self.tail_v = torch.zeros(b, hk, cap, d, **kw)
        self.sink_k = torch.zeros(b, hk, s0, d, **kw)
        self.sink_v = torch.zeros(b, hk, s0, d, **kw)
        self.hist_k = self._alloc_hist(0, b, len(self.params.int2_heads), d, g, meta)
        self.hist_v = self._alloc_hist(0, b, len(self.params.int2_heads), d, g, meta)
        if self.fp_heads:
            bits = self.config.full_precision_bits
            self.fp_k = heads.allocate(bits, b, len(self.fp_heads), 0, d, self.dtype, self.device)
            self.fp_v = heads.allocate(bits, b, len(self.fp_heads), 0, d, self.dtype, self.device)
        self.is_initialized = True

    def write_full_precision_heads(self, new_k: torch.Tensor, new_v: torch.Tensor, t_old: int) -> None:
        """Slots ``[t_old, t_old + L)`` of the full-precision heads (amortized growth). The attention function
        calls it before reading them; ``commit`` then does not write again."""
        if not self.fp_heads or self._fp_written:
            return
        t_new = t_old + new_k.shape[2]
        self.fp_k = tuple(grown(t, t_old, t_new) for t in self.fp_k)
        self.fp_v = tuple(grown(t, t_old, t_new) for t in self.fp_v)
        self._store_full_precision_rows(new_k, new_v, t_old)
        self._fp_written = True

    def full_precision_kv(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k, v) [B, P, n, D]``: slots ``[0, n)`` of the full-precision heads in the model dtype."""
        bits = self.config.full_precision_bits
        return tuple(heads.decode(tuple(t[:, :, :n] for t in store), bits, self.dtype)
                     for store in (self.fp_k, self.fp_v))

    def _store_full_precision_rows(self, new_k: torch.Tensor, new_v: torch.Tensor, t_old: int) -> None:
        """Slots ``[t_old, t_old + L)`` of the full-precision heads from ``new_k/v [B, Hk, L, D]`` (the storage
        already holds them)."""
        l = new_k.shape[2]
        for store, new in ((self.fp_k, new_k), (self.fp_v, new_v)):
            for dst, src in zip(store, heads.encode(new.index_select(1, self.params.coded_idx),
                                                    self.config.full_precision_bits)):
                dst[:, :, t_old : t_old + l] = src

    def _alloc_hist(self, cap, b, hk, d, g, meta):
        return QuantizedRows(
            torch.zeros(b, hk, cap, d // 4, dtype=torch.uint8, device=self.device),
            torch.zeros(b, hk, cap, d // g, dtype=meta, device=self.device),
            torch.zeros(b, hk, cap, d // g, dtype=meta, device=self.device),
        )

    # ------------------------------------------------------------------ Cache layer API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.pending is not None:
            raise RuntimeError(
                f"OscarCache layer {self.layer_idx}: update() was called again before the previous rows were consumed "
                "by the 'oscar_*' attention function. The model's attention does not go through OSCAR: build the "
                "cache with OscarCache(model, ...) / OscarCache.from_pretrained(path, model), or call "
                "oscar_hf.enable_oscar(model)."
            )
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

    def get_max_cache_shape(self) -> int:  # transformers < 5.2x name
        return -1

    def reset(self) -> None:
        self._clear()

    # ------------------------------------------------------------------ read
    def attend(self, handle: OscarKV, query, attention_mask, scaling: float, module, base: str, **kwargs) -> torch.Tensor:
        """Attention for one forward through this layer (see the module docstring); commits the new rows.
        ``query [B, Hq, L, D]`` -> ``[B, L, Hq, D]``."""
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

        qf = group_queries(query.float(), hk)  # [B, Hk, M, D], M = g*L
        softcap, sinks = logit_terms(kwargs, hk, l)  # sinks [Hk, M] or None
        s0 = self.config.sink
        dev = query.device
        # 1. full-precision window: sink (row b's slots pad[b] + j) + recent tail + the new rows.
        #    Its size is bounded (S0 + W + L), independent of the context length.
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
        if self.fp_heads:  # full-precision heads apart; the rest reads window + INT2 history below
            if l == 1 and key_mask is None:  # a decode step: their codes read in place
                self.write_full_precision_heads(new_k, new_v, t_old)
                out_fp = heads_decode_attention(
                    group_queries(query, hk), self.params.coded_idx, self.fp_k, self.fp_v, self.params.bits,
                    s0 + hist_start, self.tail_start, win_k, win_v, None if ok is None else ok[:, 0], scaling,
                    query.dtype, use_kernels=self.config.use_kernels, softcap=softcap,
                    sinks=self.params.coded_rows(sinks))
            else:
                out_fp = self.full_precision_heads_attention(query, new_k, new_v, win_k, win_v, ok, allowed, t_old,
                                                             scaling, softcap, self.params.coded_rows(sinks))
            qf, win_k, win_v = (x.index_select(1, self.params.int2_idx) for x in (qf, win_k, win_v))
            sinks = self.params.int2_rows(sinks)

        # 3. INT2 history, in the rotated space: q rotated once; + q.mu_K on logits; values rotated back once.
        rot = self.params
        hist_k, hist_v = self.hist_view()
        mu_k, mu_v = self.offsets()
        # 1 + 3 merged by log-sum-exp, the query rotated inside: three Triton launches on CUDA (rotation + window,
        # split-K history, combine), torch reference elsewhere.
        out = decode_attention_rotating(
            qf, rot.r_k, mu_k, hist_k, hist_v, hist_start, key_mask, scaling, self.config.group_size,
            win_k, win_v, win_mask, rot.r_v, mu_v, out_dtype=query.dtype, block_n=self.config.block_size,
            use_kernels=self.config.use_kernels, softcap=softcap, sinks=sinks,
        )
        if out_fp is not None:
            out = self.params.merge(out, out_fp.to(out.dtype))
        out = out.reshape(b, hq, l, d).transpose(1, 2).contiguous()
        self.commit(new_k, new_v, pad)
        return out

    def full_precision_heads_attention(self, query, new_k, new_v, win_k, win_v, win_ok, allowed, t_old: int,
                                       scaling: float, softcap=None, sinks=None) -> torch.Tensor:
        """``[B, P, g*L, D]``: the layer's full-precision heads over their history slots ``[S0, tail_start)`` as
        stored (``full_precision_bits``; row ``b`` from slot ``S0 + pad[b]``, the INT2 history's range) and the
        window every head reads exactly (``win_k/v [B, Hk, window, D]``: sink, recent tail, new rows; ``win_ok
        [B, L, window]`` or None when all valid): one SDPA call in the model dtype. With 16 bits this is exactly
        what a ``DynamicCache`` reads. ``softcap``, ``sinks [P, g*L]``: :func:`~oscar_hf.cache.base.logit_terms`."""
        b, hq, l, d = query.shape
        hk, s0, dev = new_k.shape[1], self.config.sink, query.device
        g = hq // hk
        self.write_full_precision_heads(new_k, new_v, t_old)
        n = max(self.tail_start - s0, 0)
        hist_k, hist_v = (x[:, :, s0:] for x in self.full_precision_kv(s0 + n))  # [B, P, n, D]
        hist_ok = (torch.arange(n, device=dev)[None, :] >= self.pad[:, None])[:, None, :].expand(b, l, n)
        if allowed is not None:
            hist_ok = hist_ok & allowed[:, :, s0 : s0 + n]
        if win_ok is None:
            win_ok = hist_ok.new_ones(b, l, win_k.shape[2])
        mask = mask_rows(torch.cat([hist_ok, win_ok], -1), g)  # [B, 1, g*L, n + window]
        q = group_queries(query, hk).index_select(1, self.params.coded_idx)  # [B, P, g*L, D]
        keys = torch.cat([hist_k, win_k.index_select(1, self.params.coded_idx)], 2)
        values = torch.cat([hist_v, win_v.index_select(1, self.params.coded_idx)], 2)
        return heads.attention(q, keys, values, mask, scaling, softcap, sinks)

    # ------------------------------------------------------------------ derived per-row views
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

    # ------------------------------------------------------------------ write path
    def commit(self, new_k: torch.Tensor, new_v: torch.Tensor, pad: torch.Tensor | None = None) -> None:
        """Append ``new_k/v [B, Hk, L, D]`` (slots ``[T, T + L)``) and demote what left the recent window."""
        if not self.is_initialized:
            self.lazy_initialization(new_k, new_v)
        self.pending = None
        self.write_full_precision_heads(new_k, new_v, self.seq_len)
        self._fp_written = False
        if self.pad is None:
            self.pad = (pad if pad is not None else torch.zeros(self.batch_size, dtype=torch.long)).to(self.device)
            self.pad_max = int(self.pad.max()) if self.pad.numel() else 0
        t_old, n_new = self.seq_len, new_k.shape[-2]
        t_new = t_old + n_new
        target = max(self._recent_start(t_new), self.tail_start)
        if target > self.tail_start:
            self._demote(self.tail_start, target, t_old, new_k, new_v)
        # Append the new rows that stay in full precision, plus the rollback reserve.
        self._append(new_k, new_v, t_old, t_new, target)
        self.tail_start = target
        self.seq_len = t_new

    def _recent_start(self, t: int) -> int:
        """First full-precision recent slot for a sequence of ``t`` slots. Nothing is quantized until
        some row has a history token: while ``t - recent <= sink`` the tail holds every slot (0)."""
        s0, w = self.config.sink, self.config.recent
        return t - w if t - w > s0 else 0

    def _source(self, a: int, b: int, t_old: int, new_k, new_v):
        """Rows of slots ``[a, b)`` from the old tail and/or the new rows (views, no copy when possible)."""
        return slot_rows(self.tail_k, self.tail_v, self.buf_slot0, t_old, a, b, new_k, new_v)

    def _demote(self, a: int, b: int, t_old: int, new_k, new_v) -> None:
        s0 = self.config.sink
        # Sink: rows whose first S0 real slots intersect [a, b) copy them in (per-row gather).
        if a < self.pad_max + s0:
            j = torch.arange(s0, device=self.device)
            slot = self.pad[:, None] + j[None, :]  # [B, S0]
            sel = (slot >= a) & (slot < b)
            lo, hi = a, min(b, self.pad_max + s0)
            src_k, src_v = self._source(lo, hi, t_old, new_k, new_v)
            idx = (slot - lo).clamp(0, hi - lo - 1)[:, None, :, None].expand(-1, self.num_kv_heads, -1, self.head_dim)
            m = sel[:, None, :, None]
            self.sink_k = torch.where(m, src_k.gather(2, idx), self.sink_k)
            self.sink_v = torch.where(m, src_v.gather(2, idx), self.sink_v)
        # History: slots [max(a, S0), b) -> indices [.. - S0], every row (masked per row on read).
        ha = max(a, s0)
        if b <= ha:
            return
        self._reserve_hist(b - s0)
        if self.config.key_offset == "prefill" and self.mu_k_seq is None:
            self.mu_k_seq = self.sequence_key_mean(self._source(0, b, t_old, new_k, new_v)[0])
        step = self.config.prefill_chunk
        r, g, meta = self.params, self.config.group_size, self.config.torch_meta_dtype
        mu_k, mu_v = self.offsets()
        uk, qz = self.config.use_kernels, self.config.quantizer
        for c0 in range(ha, b, step):
            c1 = min(b, c0 + step)
            xk, xv = (self.params.int2_part(x) for x in self._source(c0, c1, t_old, new_k, new_v))
            rotate_quantize(xk, r.r_k, mu_k, self.params.clip_k, g, meta, out=self.hist_k, out_offset=c0 - s0, use_kernels=uk,
                            quantizer=qz)
            rotate_quantize(xv, r.r_v, mu_v, self.params.clip_v, g, meta, out=self.hist_v, out_offset=c0 - s0, use_kernels=uk,
                            quantizer=qz)

    def _reserve_hist(self, n: int) -> None:
        cap = self.hist_k.codes.shape[2]
        self.hist_k, self.hist_v = (QuantizedRows(*(grown(t, cap, n) for t in q)) for q in (self.hist_k, self.hist_v))

    def _append(self, new_k, new_v, t_old: int, t_new: int, target: int) -> None:
        """Write new slots ``[first, t_new)`` into the tail buffer (``first`` includes up to
        ``CROP_RESERVE`` already-demoted slots), compacting or growing the buffer when it is full.
        Compaction copies at most ``recent + CROP_RESERVE`` rows once every ``TAIL_SLACK`` steps."""
        first = max(t_old, target - CROP_RESERVE)
        keep_from = max(self.buf_slot0, target - CROP_RESERVE)  # oldest slot worth keeping
        cap = self.tail_k.shape[2]
        if t_new - self.buf_slot0 > cap or keep_from > t_old:
            need = t_new - keep_from + TAIL_SLACK
            n_keep = max(0, t_old - keep_from)
            a = keep_from - self.buf_slot0
            old_k = self.tail_k[:, :, a : a + n_keep].clone()
            old_v = self.tail_v[:, :, a : a + n_keep].clone()
            if need > cap:
                self.tail_k = self.tail_k.new_zeros(*self.tail_k.shape[:2], need, self.head_dim)
                self.tail_v = self.tail_v.new_zeros(*self.tail_v.shape[:2], need, self.head_dim)
            self.tail_k[:, :, :n_keep] = old_k
            self.tail_v[:, :, :n_keep] = old_v
            self.buf_slot0 = keep_from
        p = first - self.buf_slot0
        self.tail_k[:, :, p : p + t_new - first] = new_k[:, :, first - t_old :]
        self.tail_v[:, :, p : p + t_new - first] = new_v[:, :, first - t_old :]

    # ------------------------------------------------------------------ generate() contract
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens. Exact (as if they were never added) while the
        demoted slots are still in the rollback reserve; beyond it the tail is refilled as far as possible."""
        if tokens_to_remove > 0:
            raise ValueError("OscarCache.crop takes a negative number of tokens to remove (transformers 5.x)")
        if self.pending is not None:
            raise RuntimeError("crop() during a forward pass")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
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

    def _batch_apply(self, fn) -> None:
        if not self.is_initialized:
            return
        self.tail_k, self.tail_v = fn(self.tail_k), fn(self.tail_v)
        self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        self.hist_k = QuantizedRows(*(fn(t) for t in self.hist_k))
        self.hist_v = QuantizedRows(*(fn(t) for t in self.hist_v))
        if self.fp_k is not None:
            self.fp_k, self.fp_v = tuple(fn(t) for t in self.fp_k), tuple(fn(t) for t in self.fp_v)
        if self.pad is not None:
            self.pad = fn(self.pad)
            self.pad_max = int(self.pad.max()) if self.pad.numel() else 0
        if self.mu_k_seq is not None:
            self.mu_k_seq = fn(self.mu_k_seq)
        self.batch_size = self.tail_k.shape[0]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        idx = beam_idx.to(self.device) if self.is_initialized else beam_idx
        self._batch_apply(lambda t: t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_apply(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    # ------------------------------------------------------------------ accounting
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
