"""`StaticOscarLayer`: one quantized layer of :class:`~oscar_hf.StaticOscarCache` (storage preallocated to
``max_cache_len``, for CUDA graphs), and its read.

What ``StaticCache`` is to ``DynamicCache``: every buffer is allocated at the first forward and
only mutated in place afterwards, the sequence length lives in a device tensor, and a one-token
decode step runs without host synchronisation, allocation that grows with the context, or
Python control flow on data. ``generate`` then compiles the decode step by itself
(``is_compileable``; ``torch.compile(mode="reduce-overhead")`` = CUDA graphs on CUDA)::

    cache = StaticOscarCache.from_pretrained(rotations_dir, model, max_cache_len=32768)
    model.generate(**inputs, cache=cache, max_new_tokens=256)   # past_key_values=cache where there is no cache=

Semantics are those of :class:`~oscar_hf.OscarCache` (same sink / recent / INT2-history
partition of every row's tokens, same quantizer); only the storage differs. One quantized layer
(``StaticOscarLayer``), ``B`` rows, ``Hk`` heads, ``S0`` sink, ``W`` recent, slot = absolute position:

* ``win_k/win_v [B, Hk, S0 + W + 1, D]`` (model dtype): ``[:S0]`` row ``b``'s first ``S0`` real
  tokens (slots ``pad[b] + j``), ``[S0:]`` a ring of ``R = W + 1`` entries holding slot ``s`` at
  ``S0 + s % R``: the last ``W`` slots plus the one a decode step adds before demoting (a decoded
  token sees ``W`` recent tokens and itself in full precision, as with ``OscarCache``);
* ``hist_k/hist_v`` (:class:`~oscar_hf.quant.QuantizedRows` ``[B, Hk, cap + 1, ...]``): slot ``s``
  at index ``s - S0`` (as in ``OscarCache``), row ``b`` reads ``pad[b] <= j < n_hist``; the last
  index is a trash row that absorbs the no-op demotions of the first steps (branch-free writes);
* ``length`` (0-d int64 device tensor) = ``T``; ``n_hist = max(0, T - W - S0)``.

A decode step (one token at slot ``T``), all tensor ops: write the new token into ring entry
``T % R`` (its previous slot ``T - R`` is already in history) and into the sink of rows still
filling it; one :func:`~oscar_hf.kernels.int2_attention.decode_attention` over ``win`` (masked per
row) and the INT2 history (``n_valid = n_hist`` read on the device); then quantize slot ``T - W``
into history index ``T - W - S0`` (or the trash row) and ``T += 1``. A prefill (``L > 1``, eager, not compiled
by ``generate``) attends over the new rows in full precision exactly like ``OscarCache`` and then
bulk-demotes with the fused write kernel.

Not supported (clear errors): ``crop`` (assisted / prompt-lookup decoding: use ``OscarCache``),
growing past ``max_cache_len``, saving a live static cache.
"""
from __future__ import annotations

import torch

from oscar_hf.kernels import num_splits, triton_enabled
from oscar_hf.kernels.int2_attention import decode_attention_rotating
from oscar_hf.kernels.write_path import rotate_quantize, rotate_quantize_reference

from ..attention import OscarKV
from ..config import OscarConfig
from ..patching import base_attention_function
from ..quant import QuantizedRows
from ..rotations import LayerRotation
from .base import QuantizedLayerBase, allowed_slots, check_first_keys, first_real_slot, group_queries, mask_rows


class StaticOscarKV(OscarKV):
    """The handle ``update`` returns (no ``__slots__``: plain attribute access for dynamo). Its shape is what
    ``StaticCache`` returns: the whole capacity (``get_mask_sizes``)."""


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _static(t: torch.Tensor) -> torch.Tensor:
    """Tag a buffer as having a fixed address (CUDA graphs re-use it instead of copying it)."""
    if not _compiling():
        torch._dynamo.mark_static_address(t)
    return t


class StaticOscarLayer(QuantizedLayerBase):
    """One quantized decoder layer with preallocated storage (see the module docstring)."""

    is_compileable = True
    is_croppable = False

    def __init__(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, max_cache_len: int):
        super().__init__(config, rotation, layer_idx)
        s0, w = config.sink, config.recent
        if w < 1:
            raise ValueError("StaticOscarCache needs recent >= 1 (the ring buffer of the recent window)")
        self.max_cache_len = int(max_cache_len)
        self.hist_cap = max(self.max_cache_len - s0 - w, 0)  # history indices 0..hist_cap-1 (+1 trash row)
        self.is_initialized = False
        self.keys = self.values = None  # CacheLayerMixin attributes; unused
        self.length = torch.zeros((), dtype=torch.long)
        self.pad_known = False  # Python flag: set at the first (eager) forward

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_first_keys(self.layer_idx, self._rotation_cpu, key_states)
        b, hk, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_kv_heads, self.head_dim = b, hk, d
        self.rot = self._rotation_cpu.to(self.device)
        for t in (self.rot.r_k, self.rot.r_v, self.rot.mu_k, self.rot.mu_v):
            if isinstance(t, torch.Tensor):
                _static(t)  # graph inputs that never change: no copy per CUDA-graph replay
        s0, w, g, meta = self.config.sink, self.config.recent, self.config.group_size, self.config.torch_meta_dtype
        kw = dict(dtype=self.dtype, device=self.device)
        self.win_k = _static(torch.zeros(b, hk, s0 + w + 1, d, **kw))
        self.win_v = _static(torch.zeros(b, hk, s0 + w + 1, d, **kw))
        n = self.hist_cap + 1

        def hist():
            return QuantizedRows(
                _static(torch.zeros(b, hk, n, d // 4, dtype=torch.uint8, device=self.device)),
                _static(torch.zeros(b, hk, n, d // g, dtype=meta, device=self.device)),
                _static(torch.zeros(b, hk, n, d // g, dtype=meta, device=self.device)),
            )

        self.hist_k, self.hist_v = hist(), hist()
        self.pad = _static(torch.zeros(b, dtype=torch.long, device=self.device))
        self.length = _static(torch.zeros((), dtype=torch.long, device=self.device))
        self.splits = None
        if self.device.type == "cuda" and self.hist_cap > 0:  # host-side grid size, fixed for the cache's life
            self.splits = num_splits(self.hist_cap, b * hk, self.device, static=True)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self.batch_size:
            raise ValueError(
                f"StaticOscarCache layer {self.layer_idx} holds batch size {self.batch_size}, got {key_states.shape[0]}"
            )
        handle = StaticOscarKV(self, key_states, value_states)
        return handle, handle

    def get_seq_length(self):
        return self.length if self.is_initialized else 0

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def get_max_cache_shape(self) -> int:  # transformers < 5.2x name
        return self.max_cache_len

    def reset(self) -> None:
        if self.is_initialized:
            for t in (self.win_k, self.win_v, self.pad, self.length, *self.hist_k, *self.hist_v):
                t.zero_()
        self.pad_known = False

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError(
            "StaticOscarCache cannot crop (assisted / prompt-lookup decoding): use the dynamic OscarCache"
        )

    # ------------------------------------------------------------------ read
    def attend(self, handle: OscarKV, query, attention_mask, scaling: float, module, base: str, **kwargs) -> torch.Tensor:
        """Attention for one forward through this layer, ``query [B, Hq, L, D]`` -> ``[B, L, Hq, D]``. One-token
        steps write first, then read the stored state with tensor ops only (what ``torch.compile`` / CUDA graphs
        capture); multi-token forwards (prefill, eager) read the old state + the new rows, then write."""
        new_k, new_v = handle.key_states, handle.value_states
        b, hq, l, d = query.shape
        hk = new_k.shape[1]
        g = hq // hk
        s0, cfg = self.config.sink, self.config
        dev = query.device
        t_old = None
        if not self.pad_known:  # first forward of this cache (eager): left padding from the mask
            t_old = int(self.length)
            allowed = allowed_slots(attention_mask, b, l, t_old + l, t_old)
            self.set_pad(first_real_slot(allowed, b, dev))
        rot = self.rot
        mu_v = self.offsets()[1]

        if l == 1:
            # Decode step: the static mask is not read: left padding was recorded at the first forward.
            self.write_one(new_k, new_v)
            t = self.length  # slot of the new token; the window holds slots [T - W, T]
            qf = group_queries(query.float(), hk)  # [B, Hk, g, D]
            win_mask = self.window_mask(t + 1, cfg.recent + 1)[:, None, None, :]  # [B, 1, 1, S0 + W + 1]
            n_valid = self.n_hist(t)
            hist_k, hist_v = self.hist_k, self.hist_v
            if not torch.compiler.is_compiling() and not triton_enabled(query, cfg.use_kernels):
                n = int(n_valid)  # eager reference: read only the filled part
                hist_k, hist_v = (QuantizedRows(*(x[:, :, :n] for x in q)) for q in (hist_k, hist_v))
                n_valid = None
            out = decode_attention_rotating(
                qf, rot.r_k, self.offsets()[0], hist_k, hist_v, self.pad, None, scaling, cfg.group_size,
                self.win_k, self.win_v, win_mask, rot.r_v, mu_v, out_dtype=query.dtype, block_n=cfg.block_size,
                use_kernels=cfg.use_kernels, n_valid=n_valid, splits=self.splits,
            )
            self.demote_one()
            return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous()

        t_old = int(self.length) if t_old is None else t_old
        kv = t_old + l
        if t_old == 0:  # prefill of an empty cache: exactly the user's attention over the prompt
            mask = attention_mask[..., :l] if attention_mask is not None and attention_mask.dim() == 4 else attention_mask
            out, _ = base_attention_function(module, base)(module, query, new_k, new_v, mask, scaling=scaling, **kwargs)
            self.commit_bulk(new_k, new_v)
            return out
        # A multi-token forward on a non-empty cache (next turn): stored window + new rows, history.
        allowed = allowed_slots(attention_mask, b, l, kv, t_old)
        if allowed is None:  # causal among the new rows
            allowed = (torch.arange(kv, device=dev)[None, :] <= (t_old + torch.arange(l, device=dev))[:, None])[None].expand(b, l, kv)
        t = torch.tensor(t_old, device=dev)
        slots = torch.cat([self.pad[:, None] + torch.arange(s0, device=dev)[None, :],  # sink j
                           self.ring_slots(t).clamp(min=0).expand(b, -1)], 1)  # ring entries
        ok = self.window_mask(t, cfg.recent)[:, None, :] & allowed.gather(2, slots.clamp(max=kv - 1)[:, None, :].expand(b, l, -1))
        ok = torch.cat([ok, allowed[:, :, t_old:]], -1)  # [B, L, S0 + W + L]
        qf = group_queries(query.float(), hk)
        n = int(self.n_hist(t))
        hist_k, hist_v = (QuantizedRows(*(x[:, :, :n] for x in q)) for q in (self.hist_k, self.hist_v))
        out = decode_attention_rotating(
            qf, rot.r_k, self.offsets()[0], hist_k, hist_v, self.pad, mask_rows(allowed[:, :, s0 : s0 + n], g), scaling,
            cfg.group_size, torch.cat([self.win_k, new_k], 2), torch.cat([self.win_v, new_v], 2), mask_rows(ok, g),
            rot.r_v, mu_v, out_dtype=query.dtype, block_n=cfg.block_size, use_kernels=cfg.use_kernels,
        )
        self.commit_bulk(new_k, new_v)
        return out.reshape(b, hq, l, d).transpose(1, 2).contiguous()

    # ------------------------------------------------------------------ positions of the window
    def n_hist(self, length: torch.Tensor) -> torch.Tensor:
        s0, w = self.config.sink, self.config.recent
        return (length - w - s0).clamp(min=0)

    def ring_slots(self, length: torch.Tensor) -> torch.Tensor:
        """``[R]``: the slot each ring entry holds once slots ``[0, length)`` are written (may be < 0)."""
        r = self.config.recent + 1
        q = torch.arange(r, device=self.device)
        return (length - 1) - torch.remainder(length - 1 - q, r)

    def window_mask(self, length: torch.Tensor, recent: int) -> torch.Tensor:
        """``[B, S0 + R]`` bool: which window entries hold row ``b``'s sink tokens or one of the last
        ``recent`` of ``length`` slots (ring entries of a row's sink or padding are masked)."""
        s0 = self.config.sink
        j = torch.arange(s0, device=self.device)
        sink_ok = j[None, :] < (length - self.pad).clamp(0, s0)[:, None]
        slot = self.ring_slots(length)
        ring_ok = (slot[None, :] >= (self.pad + s0)[:, None]) & (slot >= length - recent)[None, :]
        return torch.cat([sink_ok, ring_ok], 1)

    # ------------------------------------------------------------------ write path
    def set_pad(self, pad: torch.Tensor | None) -> None:
        if not self.pad_known:
            if pad is not None:
                self.pad.copy_(pad)
            self.pad_known = True

    def write_one(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Decode step, part 1: token ``[B, Hk, 1, D]`` at slot ``T`` into the ring (and the sink of
        rows with fewer than ``S0`` real tokens). Tensor ops only (CUDA-graph safe)."""
        s0, r = self.config.sink, self.config.recent + 1
        t = self.length
        if not _compiling() and int(t) >= self.max_cache_len:
            raise ValueError(f"StaticOscarCache is full (max_cache_len={self.max_cache_len})")
        ring = (s0 + torch.remainder(t, r)).reshape(1)
        self.win_k.index_copy_(2, ring, new_k)
        self.win_v.index_copy_(2, ring, new_v)
        if s0 == 0:
            return
        r_b = t - self.pad  # [B] real tokens of each row before this one
        in_sink = ((r_b >= 0) & (r_b < s0))[:, None, None, None]
        idx = r_b.clamp(0, s0 - 1)[:, None, None, None].expand(-1, self.num_kv_heads, 1, self.head_dim)
        for win, new in ((self.win_k, new_k), (self.win_v, new_v)):
            win.scatter_(2, idx, torch.where(in_sink, new, win.gather(2, idx)))

    def demote_one(self) -> None:
        """Decode step, part 2 (after the attention): slot ``T - W`` leaves the recent window and is
        quantized to history index ``T - W - S0`` (the trash row when it is not a history slot); ``T += 1``."""
        s0, w, g, meta = self.config.sink, self.config.recent, self.config.group_size, self.config.torch_meta_dtype
        t = self.length
        ring = (s0 + torch.remainder(t - w, w + 1)).reshape(1)
        e = t - w - s0
        j = torch.where((e >= 0) & (e < self.hist_cap), e, torch.full_like(e, self.hist_cap)).reshape(1)
        mu_k, mu_v = self.offsets()
        for win, hist, r, mu, clip in ((self.win_k, self.hist_k, self.rot.r_k, mu_k, self.clip_k),
                                       (self.win_v, self.hist_v, self.rot.r_v, mu_v, self.clip_v)):
            q = rotate_quantize_reference(win.index_select(2, ring), r, mu, clip, g, meta)  # one row [B, Hk, 1, ...]
            for dst, src in zip(hist, q):
                dst.index_copy_(2, j, src)
        self.length.add_(1)

    def commit_bulk(self, new_k: torch.Tensor, new_v: torch.Tensor) -> None:
        """Prefill / multi-token forward (eager): slots ``[T, T + L)``."""
        s0, w, g, meta = self.config.sink, self.config.recent, self.config.group_size, self.config.torch_meta_dtype
        t_old, n_new = int(self.length), new_k.shape[2]
        t_new = t_old + n_new
        if t_new > self.max_cache_len:
            raise ValueError(f"StaticOscarCache: {t_new} tokens exceed max_cache_len={self.max_cache_len}")
        dev = self.device
        # 1. history: slots [max(T - W, S0), T + L - W), from the ring (< T) or the new rows (>= T)
        a, b = max(t_old - w, s0), t_new - w
        mu_k, mu_v = self.offsets()
        for c0 in range(a, b, self.config.prefill_chunk):
            c1 = min(b, c0 + self.config.prefill_chunk)
            ring_idx = s0 + torch.remainder(torch.arange(c0, max(c0, min(c1, t_old)), device=dev), w + 1)
            for win, new, hist, r, mu, clip in (
                (self.win_k, new_k, self.hist_k, self.rot.r_k, mu_k, self.clip_k),
                (self.win_v, new_v, self.hist_v, self.rot.r_v, mu_v, self.clip_v),
            ):
                x = torch.cat([win.index_select(2, ring_idx), new[:, :, max(c0, t_old) - t_old : c1 - t_old]], 2)
                rotate_quantize(x, r, mu, clip, g, meta, out=hist, out_offset=c0 - s0, use_kernels=self.config.use_kernels)
        # 2. sink: row b's real token j sits at slot pad[b] + j
        slot = self.pad[:, None] + torch.arange(s0, device=dev)[None, :]  # [B, S0]
        sel = ((slot >= t_old) & (slot < t_new))[:, None, :, None]
        idx = (slot - t_old).clamp(0, n_new - 1)[:, None, :, None].expand(-1, self.num_kv_heads, -1, self.head_dim)
        for win, new in ((self.win_k, new_k), (self.win_v, new_v)):
            win[:, :, :s0] = torch.where(sel, new.gather(2, idx), win[:, :, :s0])
        # 3. ring: the last R = W + 1 slots (the oldest of them is in history already)
        first = max(t_old, t_new - w - 1)
        ring_idx = s0 + torch.remainder(torch.arange(first, t_new, device=dev), w + 1)
        self.win_k.index_copy_(2, ring_idx, new_k[:, :, first - t_old :])
        self.win_v.index_copy_(2, ring_idx, new_v[:, :, first - t_old :])
        self.length.fill_(t_new)

    # ------------------------------------------------------------------ generate() contract
    def _batch_apply(self, fn) -> None:
        if not self.is_initialized:
            return
        for t in (self.win_k, self.win_v, self.pad, *self.hist_k, *self.hist_v):
            t.copy_(fn(t))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        idx = beam_idx.to(self.device) if self.is_initialized else beam_idx
        self._batch_apply(lambda t: t.index_select(0, idx))

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("StaticOscarCache has a fixed batch size; build it after expanding the batch")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("StaticOscarCache has a fixed batch size")

    def offload(self):
        raise NotImplementedError("StaticOscarCache does not support offloading")

    def prefetch(self):
        return None

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        """Bytes used by the cached tokens (logical, as ``OscarLayer.memory``) and allocated."""
        z = dict(sink=0, recent=0, history_codes=0, history_meta=0, history_elements=0, allocated=0, tokens=0)
        if not self.is_initialized:
            return z
        s0, w, g = self.config.sink, self.config.recent, self.config.group_size
        hk, d, el = self.num_kv_heads, self.head_dim, self.win_k.element_size()
        t = self.length
        mask = self.window_mask(t, w)
        n_sink, n_rec = int(mask[:, :s0].sum()), int(mask[:, s0:].sum())
        n_hist = int((self.n_hist(t) - self.pad).clamp(min=0).sum())
        meta_el = self.hist_k.scale.element_size()
        alloc = sum(x.numel() * x.element_size() for x in (self.win_k, self.win_v, *self.hist_k, *self.hist_v))
        return dict(
            sink=2 * n_sink * hk * d * el, recent=2 * n_rec * hk * d * el,
            history_codes=2 * n_hist * hk * d // 4, history_meta=2 * n_hist * hk * (d // g) * 2 * meta_el,
            history_elements=2 * n_hist * hk * d, allocated=alloc, tokens=n_sink + n_rec + n_hist,
        )
