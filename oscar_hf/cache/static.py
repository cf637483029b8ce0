"""`StaticOscarLayer`: one quantized layer whose storage lives on the device in fixed-address buffers, so that
``generate`` compiles the decode step (``torch.compile`` + CUDA graphs). :class:`~oscar_hf.OscarCache` uses it on
CUDA by itself (``compile="auto"``); :class:`~oscar_hf.StaticOscarCache` with a fixed ``max_cache_len``.

Semantics are those of the eager :class:`~oscar_hf.cache.dynamic.OscarLayer` (same sink / recent / INT2-history
partition of every row's tokens, same quantizer); only the storage differs. Its layout and multi-token writes are
the serving store's (:mod:`oscar_hf.cache.window`), with left-padded rows. ``B`` rows, ``Hk`` KV heads (``Hq`` of
them quantized in INT2, ``P`` retrieval heads coded), ``S0`` sink, ``W`` recent, slot = absolute position:

* ``win [2, B, Hk, S0 + R, D]`` (keys, values; model dtype, every head; ``win_k``/``win_v`` its two views): ``[:S0]``
  row ``b``'s first ``S0`` real tokens
  (slot ``pad[b] + j`` at entry ``j``), ``[S0:]`` a ring of ``R = W + 1 + RING_RESERVE`` entries, slot ``s`` at
  ``S0 + s % R``. A decode step reads ``W`` recent tokens and itself from it; the ``RING_RESERVE`` older entries,
  already in the history, let ``crop(-n)`` (assisted decoding) undo up to that many tokens exactly;
* the history, slot ``s >= S0`` at index ``s - S0`` of ``N`` rows, row ``b`` reading ``pad[b] <= j < T - W - S0``:
  ``codes [2, B, Hq, N, D/4]`` and ``meta [2, 2, B, Hq, N, D/G]`` (keys, values; scale, zero), viewed as ``hist_k/hist_v``
  (:class:`~oscar_hf.quant.QuantizedRows` ``[B, Hq, N, ...]``), the INT2 heads, and ``coded_x [2, B, P, N, *]`` and
  ``coded_meta [2, 2, B, P, N, 1]`` (:mod:`oscar_hf.cache.heads`: INT8/INT4 codes with a scale and zero per token and
  head, or the rows in the model dtype and no metadata), viewed as ``coded_k/coded_v`` (tuples of ``[B, P, N, *]``),
  the retrieval heads (``OscarConfig.full_precision_heads``; None without);
* ``length`` (0-d int64 device tensor, one for all the cache's layers on a device: :class:`StepShared`) = ``T``;
  ``host_len`` the same count on the host, kept by the eager calls
  and by the compiled step's wrapper (:mod:`oscar_hf.compiled_step`), which grows the storage before a step that
  would not fit it: ``N`` grows in capacity buckets (:func:`capacity_for`); the first growth recompiles the step
  once (with ``N`` symbolic), each later bucket records one more CUDA graph.

A decode step (one token at slot ``T``), device tensors only, no host synchronisation, one op per layer after the
query's rotation (:func:`~oscar_hf.kernels.static_op.decode_step`): one fused write (demote slot ``T - 1 - W`` from
the ring into the history, the INT2 heads quantized and the retrieval heads coded, then write the new token into the
ring and the sink of rows still filling it), one decode attention over the window (masked per row) and the history
(``n_valid = T - W - S0`` read on the device; the retrieval heads' in place, merged at their KV heads), ``T += 1``.
A multi-token forward (prefill, next turn; eager, never compiled: the step wrapper runs it through the plain model)
attends over the new rows in full precision like ``OscarLayer`` and bulk-demotes
(:func:`~oscar_hf.cache.window.commit`).
"""
from __future__ import annotations

import math

import torch

from oscar_hf.kernels.int2_attention import decode_attention_rotating, rotate_query
from oscar_hf.kernels.static_op import (NO_HEADS, decode_step_op, join_heads_index, split_heads_index,
                                        step_config, step_heads, step_storage)

from ..attention import OscarKV
from ..config import OscarConfig
from ..patching import base_attention_function
from ..quant import QuantizedRows, dequantize_rows
from ..rotations import LayerRotation
from . import heads
from .base import QuantizedLayerBase, allowed_slots, first_real_slot, group_queries, logit_terms, mask_rows
from .window import RowsHistory, commit, demote_pending, ring_entries, ring_slots, window_mask

RING_RESERVE = 64  # ring entries beyond W + 1: crop(-n) is exact for n <= RING_RESERVE (as OscarLayer's CROP_RESERVE)
BUCKET = 1024  # capacity granularity (slots)
HEADROOM = 1 / 8  # a fresh allocation leaves room for this fraction of its length (at least BUCKET slots) ...
GROWTH = 1.5  # ... and a full one grows by this factor: few buckets (CUDA graphs) over a long generation
RESERVE_FACTOR = 4  # generate's own length (prompt + max_new_tokens) is allocated up front, up to this many times
# what ``need`` alone would get: a chat turn's answer then fits without a growth (each growth re-records a CUDA graph,
# the first one recompiles the step), while a far-off max_length (a model default) does not reserve it all


def capacity_for(need: int, current: int = 0, expected: int = 0) -> int:
    """Slots to allocate for ``need`` tokens: ``need`` plus headroom, or ``GROWTH`` x the current capacity when
    growing, raised to ``expected`` (the length ``generate`` will reach; at most ``RESERVE_FACTOR`` x that), rounded
    up to ``BUCKET``."""
    want = max(need + max(int(need * HEADROOM), BUCKET), int(current * GROWTH))
    if expected > want:
        want = min(expected, RESERVE_FACTOR * want)
    return int(math.ceil(want / BUCKET) * BUCKET)


class StaticOscarKV(OscarKV):
    """The handle ``update`` returns (no ``__slots__``: plain attribute access for dynamo)."""


class StepShared:
    """What every compiled OSCAR layer of one decode forward reads alike, computed once by the first of them: the
    length ``t`` (0-d) and left padding ``pad [B]``, the window mask ``[B, 1, 1, S0 + R]`` and the history length
    (0-d). Per layer these were ~25 of the step graph's ~35 extra nodes per layer over BF16's, which the first call
    traces, functionalizes and lowers 36 times (``docs/results.md``, the first call).

    The layers of one device also share one length tensor (:meth:`join`): they step together, and the step graph then
    takes one length and one ``pad`` as inputs, not one of each per layer (each graph input costs the compiled call
    a guard, a load and a pointer check on every step). The last layer of the device advances it, once a step.

    The cache hands one instance to all its :class:`StaticOscarLayer` layers (a lone layer keeps its own). A layer
    recomputes when it is not after the one that computed or is on another device (a new forward: layers run in index
    order); the last layer clears it, so every trace starts from the same state and dynamo's guards on it hold from
    step to step."""

    def __init__(self):
        self.last_layer = None  # index of the last layer that shares it (None: every layer clears it)
        self.lengths = {}  # device -> (its layers' length tensor, the layer that advances it)
        self.config = None  # the decode op's StepConfig (the same for every layer)
        self.clear()

    def clear(self) -> None:
        self.layer_idx, self.key, self.t, self.pad, self.win_mask, self.hist_len = -1, None, None, None, None, None

    def join(self, layer: "StaticOscarLayer") -> torch.Tensor:
        """The length tensor of ``layer``'s device (0-d int64, shared by the layers there); the highest-index layer of
        the device is the one that advances it (``advances_length``)."""
        length, last = self.lengths.get(layer.device, (None, None))
        if length is None:
            length = _static(torch.zeros((), dtype=torch.long, device=layer.device))
        if last is None or layer.layer_idx >= last.layer_idx:
            if last is not None:
                last.advances_length = False
            last = layer
        layer.advances_length = last is layer
        self.lengths[layer.device] = (length, last)
        return length


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def _static(t: torch.Tensor) -> torch.Tensor:
    """Tag a buffer as having a fixed address (CUDA graphs re-use it instead of copying it). Capacity dimensions are
    not marked dynamic: the first compile of the step sees fixed sizes (symbolic sizes made it ~1.4x slower to trace
    and compile); a capacity growth then recompiles once, and torch's automatic dynamic shapes make the capacity
    symbolic in that second graph, so that later buckets only re-record the CUDA graph."""
    if not _compiling():
        torch._dynamo.mark_static_address(t)
    return t


class StaticOscarLayer(QuantizedLayerBase):
    """One quantized decoder layer with device-resident storage (see the module docstring). ``max_cache_len``
    fixes the capacity (:class:`~oscar_hf.StaticOscarCache`); None lets it grow in buckets."""

    is_compileable = True
    is_croppable = True

    def __init__(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, max_cache_len: int | None = None,
                 fp_heads=()):
        super().__init__(config, rotation, layer_idx, fp_heads)
        if config.recent < 1:
            raise ValueError("the compiled OSCAR cache needs recent >= 1 (the ring buffer of the recent window)")
        self.fixed_capacity = None if max_cache_len is None else int(max_cache_len)
        self.ring = config.recent + 1 + RING_RESERVE
        self.is_initialized = False
        self.keys = self.values = None  # CacheLayerMixin attributes; unused
        self.win = self.codes = self.meta = None  # the storage (lazy_initialization)
        self.coded_x = self.coded_meta = None
        self.length = torch.zeros((), dtype=torch.long)
        self.advances_length = True
        self.capacity = 0
        self.host_len = 0  # T on the host (no sync needed to know it)
        self.expected_len = 0  # the length generate will reach (set by the compiled step's hook; 0: unknown)
        self.announced = False  # the compiled step's wrapper already counted this forward's token
        self.pad_known = False  # Python flag: set at the first (eager) forward
        self.step = StepShared()  # replaced by the cache's one, shared by its layers

    # ------------------------------------------------------------------ storage
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        params = self.build_params(key_states)
        b, hk, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.batch_size, self.num_kv_heads, self.head_dim = b, hk, d
        dev = self.device
        # Each tensor this layer's own (~1 MB per layer): a step whose inputs alias (e.g. the built-in Hadamard
        # rotation shared by K and V and by every layer) loses its static-input marks under CUDA graphs (torch 2.11),
        # which then skip the whole step. Static: graph inputs that never change, no copy per CUDA-graph replay.
        self.params = params.with_tensors(lambda t: _static(t.clone()))
        kw = dict(dtype=self.dtype, device=dev)
        s0 = self.config.sink
        self.win = _static(torch.zeros(2, b, hk, s0 + self.ring, d, **kw))
        self.pad = _static(torch.zeros(b, dtype=torch.long, device=dev))
        self.length = self.step.join(self)
        self.codes = self.meta = None
        self.coded_x = self.coded_meta = None
        self.heads_index = None
        if self.fp_heads:
            prm = self.params
            self.heads_index = _static(join_heads_index(prm.hist_of, prm.coded_of, prm.int2_idx, prm.coded_idx))
        self.capacity = 0
        self._allocate(self.fixed_capacity or capacity_for(max(self.host_len, key_states.shape[2]), 0, self.expected_len))
        self.is_initialized = True

    # One tensor per kind of storage, keys and values stacked (each tensor is one input of the compiled step: a view
    # of it taken inside the step costs nothing per call). Views for the code that reads and writes them:
    @property
    def win_k(self) -> torch.Tensor:
        return self.win[0]  # [B, Hk, S0 + R, D]

    @property
    def win_v(self) -> torch.Tensor:
        return self.win[1]

    @property
    def hist_k(self) -> QuantizedRows | None:
        return None if self.codes is None else QuantizedRows(self.codes[0], self.meta[0, 0], self.meta[0, 1])

    @property
    def hist_v(self) -> QuantizedRows | None:
        return None if self.codes is None else QuantizedRows(self.codes[1], self.meta[1, 0], self.meta[1, 1])

    @property
    def coded_k(self) -> tuple[torch.Tensor, ...] | None:
        """The retrieval heads' key store (:mod:`.heads`' parts ``[B, P, N, *]``: views of ``coded_x`` and
        ``coded_meta``), None without retrieval heads."""
        return self._coded(0)

    @property
    def coded_v(self) -> tuple[torch.Tensor, ...] | None:
        return self._coded(1)

    def _coded(self, i: int):
        if self.coded_x is None:
            return None
        return (self.coded_x[i],) if self.coded_meta is None else (self.coded_x[i], *self.coded_meta[i])

    def _hist_rows(self, capacity: int) -> int:
        return max(capacity - self.config.sink - self.config.recent, 1)

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate the capacity-sized buffers (the history: INT2 rows and retrieval heads' coded rows), keeping
        their content."""
        b, d, dev = self.batch_size, self.head_dim, self.device
        g, meta = self.config.group_size, self.config.torch_meta_dtype
        hq, p, n = len(self.params.int2_heads), len(self.fp_heads), self._hist_rows(capacity)

        def grow(old, *shape, dtype, dim=2):  # ``dim``: the capacity's
            new = torch.zeros(*shape, dtype=dtype, device=dev)
            if old is not None:
                k = min(old.shape[dim], new.shape[dim])
                new.narrow(dim, 0, k).copy_(old.narrow(dim, 0, k))
            return _static(new)

        # codes [2 (K, V), B, Hq, N, D/4]; meta [2 (K, V), 2 (scale, zero), B, Hq, N, D/G]
        self.codes = grow(self.codes, 2, b, hq, n, d // 4, dtype=torch.uint8, dim=3)
        self.meta = grow(self.meta, 2, 2, b, hq, n, d // g, dtype=meta, dim=4)
        if p:  # the retrieval heads' stores, keys and values stacked as the INT2 history's: coded_x [2, B, P, N, X]
            # (codes, or the rows at 16 bits), coded_meta [2, 2 (scale, zero), B, P, N, 1] (None at 16 bits)
            (last, dt), *meta_spec = heads.part_specs(self.config.full_precision_bits, d, self.dtype)
            self.coded_x = grow(self.coded_x, 2, b, p, n, last, dtype=dt, dim=3)
            if meta_spec:
                self.coded_meta = grow(self.coded_meta, 2, 2, b, p, n, 1, dtype=meta_spec[0][1], dim=4)
        self.capacity = capacity
        self._bind_step_storage()

    def _bind_step_storage(self) -> None:
        """The decode op's arguments that change only with the buffers (:class:`~oscar_hf.kernels.static_op.StepStorage`
        and ``StepHeads``: tuples read by the traced step); rebuilt whenever a buffer is replaced. The config's part
        (``StepConfig``) goes on the :class:`StepShared` that the layers share."""
        cfg, prm = self.config, self.params
        self.step_storage = step_storage(self.win, self.codes, self.meta, prm.r, prm.clip_k, prm.clip_v)
        self.step_heads = NO_HEADS
        if self.fp_heads:
            self.step_heads = step_heads(self.heads_index, self.coded_x, self.coded_meta)
        self.step.config = step_config(cfg.group_size, cfg.torch_meta_dtype, cfg.sink, cfg.recent, cfg.use_kernels,
                                       cfg.quantizer, cfg.full_precision_bits, cfg.block_size)

    def advance(self, n: int) -> None:
        """Host side, before ``n`` new tokens are written: make room for them (a bigger bucket when needed)."""
        need = self.host_len + n
        if need > self.capacity and self.is_initialized:
            if self.fixed_capacity:
                raise ValueError(f"StaticOscarCache is full (max_cache_len={self.fixed_capacity}, {need} tokens)")
            # a decode step outgrowing its bucket grows it by GROWTH (few CUDA graphs over a long generation); a
            # multi-token forward (prefill chunk) to its own need plus headroom (no x1.5 overshoot per chunk)
            self._allocate(capacity_for(need, self.capacity if n == 1 else 0, self.expected_len))
        self.host_len = need

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not _compiling():
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            self.check_update(key_states)
            if self.announced:  # the compiled step's wrapper counted it (and this forward fell back to eager)
                self.announced = False
            else:
                self.advance(key_states.shape[2])
        handle = StaticOscarKV(self, key_states, value_states)
        return handle, handle

    def get_seq_length(self):
        if _compiling():
            return self.length  # a device tensor inside the compiled step: no guard on a changing int
        return self.host_len

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        # A decode step reads no mask (left padding was taken at the first forward): a one-slot mask keeps the
        # compiled step's inputs of fixed shape. Multi-token forwards (eager) get the dynamic layer's full mask.
        # A fixed capacity keeps StaticCache's full-size mask (a skipped StaticLayer may read it).
        if self.fixed_capacity:
            return self.fixed_capacity, 0
        if query_length == 1:
            return 1, (0 if _compiling() else self.host_len)
        return self.host_len + query_length, 0

    def get_max_length(self) -> int:
        return self.fixed_capacity or -1

    def get_max_cache_shape(self) -> int:  # transformers < 5.2x name
        return self.get_max_length()

    def reset(self) -> None:
        if self.is_initialized:
            for t in (self.win, self.pad, self.length, self.codes, self.meta):
                t.zero_()
            for t in (self.coded_x, self.coded_meta):
                if t is not None:
                    t.zero_()
        self.mu_k_seq = None
        self.pad_known = False
        self.host_len = 0
        self.announced = False

    # ------------------------------------------------------------------ read
    def attend(self, handle: OscarKV, query, attention_mask, scaling: float, module, base: str, **kwargs) -> torch.Tensor:
        """Attention for one forward through this layer, ``query [B, Hq, L, D]`` -> ``[B, L, Hq, D]``. One-token
        steps write first, then read the stored state with tensor ops only (what ``torch.compile`` / CUDA graphs
        capture); multi-token forwards (prefill, eager) read the old state + the new rows, then write."""
        new_k, new_v = handle.key_states, handle.value_states
        b, hq, l, d = query.shape
        t_old = None
        if not self.pad_known:  # first forward of this cache (eager): left padding from the mask
            t_old = self.host_len - l
            allowed = allowed_slots(attention_mask, b, l, t_old + l, t_old)
            self.pad.copy_(first_real_slot(allowed, b, query.device))
            self.pad_known = True
        if l == 1:
            return self._decode_step(query, new_k, new_v, scaling, *logit_terms(kwargs, self.num_kv_heads, 1))
        return self._multi_token(query, new_k, new_v, attention_mask, scaling, module, base, t_old, **kwargs)

    def _decode_step(self, query, new_k, new_v, scaling: float, softcap=None, sinks=None) -> torch.Tensor:
        """``softcap``, ``sinks [Hk, g]``: :func:`~oscar_hf.cache.base.logit_terms`. The query's rotation is torch ops
        here (Inductor fuses them with the projection's epilogue: faster end to end than a launch inside the op,
        docs/kernels.md); the write and the attention are one opaque op
        (:func:`~oscar_hf.kernels.static_op.decode_step`)."""
        b, hq, _, d = query.shape
        # t: slot of the new token (the window then holds slots [T - W, T]); pad, win_mask, hist_len: StepShared
        t, pad, win_mask, hist_len = self._step_state()
        mu_k, mu_v = self.offsets()
        q = group_queries(query, self.num_kv_heads)  # [B, Hk, g, D]
        q_rot = qk_off = None
        if self.params.int2_heads:  # [B, Hq, g, D] float32, [B, Hq, g]
            qi = q.float()
            if self.fp_heads:  # the INT2 heads' KV heads: a slice of the op's index, not one more input of the step
                int2_idx = split_heads_index(self.step_heads.heads_index, self.num_kv_heads,
                                             len(self.params.int2_heads))[2]
                qi = qi.index_select(1, int2_idx)
            q_rot, qk_off = rotate_query(qi, self.params.r_k, mu_k, self.config.use_kernels)
            q_rot = q_rot.contiguous()
        out = decode_step_op(q, q_rot, qk_off, new_k, new_v, t, pad, win_mask, hist_len, mu_k, mu_v, float(scaling),
                             query.dtype, sinks, float(softcap or 0.0), *self.step_storage,
                             *(self.step_heads if self.fp_heads else NO_HEADS), *self.step.config)
        # (NO_HEADS through its module global, not the layer's attribute: one set of guards for all such layers)
        if self.advances_length:  # the last layer of its device: once for all of them
            t.add_(1)
        if self.step.last_layer is None or self.layer_idx >= self.step.last_layer:
            self.step.clear()
        return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous()

    def _step_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(t 0-d, pad [B], win_mask [B, 1, 1, S0 + R], hist_len 0-d)`` of a decode step (:class:`StepShared`, from
        the first layer of the forward on this device): the new token's slot, the rows' left padding, the window's
        sink, ``W`` recent tokens and the new one; history slots ``[S0, T - W)`` once this step's write demoted slot
        ``T - 1 - W``."""
        step, key = self.step, (self.config.sink, self.ring, self.config.recent, self.batch_size, self.device)
        if step.key != key or self.layer_idx <= step.layer_idx:
            step.t, step.pad = self.length, self.pad
            step.win_mask = self.window_mask(self.length + 1, self.config.recent + 1)[:, None, None, :]
            step.hist_len, step.key = self.n_hist(self.length), key
        step.layer_idx = self.layer_idx
        return step.t, step.pad, step.win_mask, step.hist_len

    def _multi_token(self, query, new_k, new_v, attention_mask, scaling, module, base, t_old, **kwargs):
        b, hq, l, d = query.shape
        hk, cfg, s0, dev = self.num_kv_heads, self.config, self.config.sink, query.device
        g = hq // hk
        t_old = self.host_len - l if t_old is None else t_old
        kv = t_old + l
        if t_old == 0:  # prefill of an empty cache: exactly the user's attention over the prompt
            mask = attention_mask[..., :l] if attention_mask is not None and attention_mask.dim() == 4 else attention_mask
            out, _ = base_attention_function(module, base)(module, query, new_k, new_v, mask, scaling=scaling, **kwargs)
            self.commit_bulk(new_k, new_v, t_old)
            return out
        # A multi-token forward on a non-empty cache (next turn, chunked prefill, assisted decoding's verification):
        # the history up to T - W (the last decode step's pending demotion done first), the stored window's slots
        # [T - W, T) and the sink, and the new rows.
        self._demote_pending(t_old)
        allowed = allowed_slots(attention_mask, b, l, kv, t_old)
        if allowed is None:  # causal among the new rows
            allowed = (torch.arange(kv, device=dev)[None, :] <= (t_old + torch.arange(l, device=dev))[:, None])[None].expand(b, l, kv)
        t = torch.tensor(t_old, device=dev)
        slots = torch.cat([self.pad[:, None] + torch.arange(s0, device=dev)[None, :],  # sink j
                           self.ring_slots(t).clamp(min=0).expand(b, -1)], 1)  # ring entries
        ok = self.window_mask(t, cfg.recent)[:, None, :] & allowed.gather(2, slots.clamp(max=kv - 1)[:, None, :].expand(b, l, -1))
        ok = torch.cat([ok, allowed[:, :, t_old:]], -1)  # [B, L, S0 + R + L]
        qf = group_queries(query.float(), hk)
        softcap, sinks = logit_terms(kwargs, hk, l)  # sinks [Hk, g*L] or None
        n = max(t_old - cfg.recent - s0, 0)
        hist_k, hist_v = (QuantizedRows(*(x[:, :, :n] for x in q)) for q in (self.hist_k, self.hist_v))
        win_k, win_v = torch.cat([self.win_k, new_k], 2), torch.cat([self.win_v, new_v], 2)
        q_part = qf
        if self.fp_heads:
            q_part, win_k, win_v = (x.index_select(1, self.params.int2_idx) for x in (qf, win_k, win_v))
        mu_k, mu_v = self.offsets()
        out = decode_attention_rotating(
            q_part, self.params.r_k, mu_k, hist_k, hist_v, self.pad, mask_rows(allowed[:, :, s0 : s0 + n], g), scaling,
            cfg.group_size, win_k, win_v, mask_rows(ok, g), self.params.r_v, mu_v, out_dtype=query.dtype,
            block_n=cfg.block_size, use_kernels=cfg.use_kernels, softcap=softcap, sinks=self.params.int2_rows(sinks),
        )
        if self.fp_heads:  # their coded history [0, n) and the window above, exact
            q = qf.index_select(1, self.params.coded_idx).to(self.dtype)  # [B, P, g*L, D]
            hist_ok = allowed[:, :, s0 : s0 + n] & (torch.arange(n, device=dev)[None, None, :] >= self.pad[:, None, None])
            k, v = (torch.cat([heads.decode(tuple(x[:, :, :n] for x in coded), cfg.full_precision_bits, self.dtype),
                               w.index_select(1, self.params.coded_idx), new.index_select(1, self.params.coded_idx)], 2)
                    for coded, w, new in ((self.coded_k, self.win_k, new_k), (self.coded_v, self.win_v, new_v)))
            out_fp = heads.attention(q, k, v, mask_rows(torch.cat([hist_ok, ok], -1), g), scaling, softcap,
                                     self.params.coded_rows(sinks))
            out = self.params.merge(out, out_fp.to(out.dtype))
        self.commit_bulk(new_k, new_v, t_old)
        return out.reshape(b, hq, l, d).transpose(1, 2).contiguous()

    # ------------------------------------------------------------------ positions of the window
    def n_hist(self, length: torch.Tensor) -> torch.Tensor:
        s0, w = self.config.sink, self.config.recent
        return (length - w - s0).clamp(min=0)

    def ring_slots(self, length: torch.Tensor) -> torch.Tensor:
        """``[R]``: the slot each ring entry holds once slots ``[0, length)`` are written (may be < 0)."""
        return ring_slots(length, self.ring)

    def window_mask(self, length: torch.Tensor, recent: int) -> torch.Tensor:
        """``[B, S0 + R]`` bool: :func:`window_mask` of every row at ``length`` (0-d) from its left padding."""
        return window_mask(length, self.pad, self.config.sink, self.ring, recent)

    # ------------------------------------------------------------------ write path (eager, multi-token)
    def _history(self) -> RowsHistory:
        """Where this layer's history entries live (:mod:`.window`'s writes): index ``slot - S0`` of every row."""
        return RowsHistory(self.hist_k, self.hist_v, self.coded_k, self.coded_v)

    def _demote_pending(self, t: int) -> None:
        """Slot ``t - 1 - W``, which the last decode step left in the window, into the history
        (:func:`~oscar_hf.cache.window.demote_pending`)."""
        demote_pending(self.win_k, self.win_v, self._history(), self.params, self.config, t, self.mu_k_seq)

    def commit_bulk(self, new_k: torch.Tensor, new_v: torch.Tensor, t_old: int) -> None:
        """Prefill / multi-token forward (eager): slots ``[T, T + L)`` (:func:`~oscar_hf.cache.window.commit`), the
        history centered on the sequence's key mean (``key_offset="prefill"``) when this write demotes its first."""
        s0, w = self.config.sink, self.config.recent
        t_new = t_old + new_k.shape[2]
        b = t_new - w
        if b > max(t_old - w, s0) and t_old == 0 and self.config.key_offset == "prefill" and self.mu_k_seq is None:
            self.mu_k_seq = _static(self.sequence_key_mean(new_k[:, :, :b]))
        commit(self.win_k, self.win_v, self.pad, self._history(), self.params, self.config, t_old, new_k, new_v,
               self.mu_k_seq)
        self.length.fill_(t_new)

    # ------------------------------------------------------------------ generate() contract
    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens: exact for up to ``RING_RESERVE`` tokens (their window
        predecessors are still in the ring); beyond it the window slots that left the ring are refilled from the
        history (INT2 rows dequantized, retrieval heads decoded), as if they had stayed in it."""
        if tokens_to_remove > 0:
            raise ValueError("OscarCache.crop takes a negative number of tokens to remove (transformers 5.x)")
        n = -tokens_to_remove
        if n == 0 or not self.is_initialized:
            return
        t_old, t_new = self.host_len, max(0, self.host_len - n)
        lost = range(max(t_new - self.config.recent - 1, self.config.sink), min(t_old - self.ring, t_new))
        if len(lost):  # window slots no longer in the ring: back from the history
            self._refill_ring(lost.start, lost.stop)
        self.host_len = t_new
        self.length.fill_(t_new)
        if t_new == 0:
            self.pad_known = False
            self.mu_k_seq = None

    def _refill_ring(self, a: int, b: int) -> None:
        """Window slots ``[a, b)`` (history slots ``>= S0``) back into their ring entries from the history: the INT2
        heads dequantized, rotated back and offset, the retrieval heads decoded from their coded rows."""
        s0, g = self.config.sink, self.config.group_size
        idx = ring_entries(torch.arange(a, b, device=self.device), s0, self.ring)
        for win, hist, coded, r, mu in ((self.win_k, self.hist_k, self.coded_k, self.params.r_k, self.offsets()[0]),
                                        (self.win_v, self.hist_v, self.coded_v, self.params.r_v, self.offsets()[1])):
            x = None  # [B, Hq, b - a, D]
            if self.params.int2_heads:
                rows = dequantize_rows(QuantizedRows(*(h[:, :, a - s0 : b - s0] for h in hist)), g)  # rotated, centered
                x = torch.matmul(rows, r.transpose(-1, -2).unsqueeze(0))
                if mu is not None:
                    x = x + (mu[None, :, None, :] if mu.dim() == 2 else mu[:, :, None, :])
            if self.fp_heads:  # [B, P, b - a, D] decoded, merged with the INT2 heads' rows into [B, Hk, b - a, D]
                x = self.params.merge(x, heads.decode(tuple(c[:, :, a - s0 : b - s0] for c in coded),
                                                      self.config.full_precision_bits, self.dtype))
            win.index_copy_(2, idx, x.to(self.dtype))

    def _batch_apply(self, fn, in_place: bool) -> None:
        """Apply ``fn`` (a batch-dim op) to every per-row buffer: in place (same batch size: beam reorder, keeps the
        CUDA graphs' addresses) or by reallocation (new batch size)."""
        if not self.is_initialized:
            return

        def apply(t, dim):  # fn along the batch dimension ``dim`` of ``t``
            out = fn(t.movedim(dim, 0)).movedim(0, dim)
            if in_place:
                return t.copy_(out)
            return _static(out.contiguous())

        for name, dim in (("win", 1), ("codes", 1), ("meta", 2), ("coded_x", 1), ("coded_meta", 2), ("pad", 0),
                          ("mu_k_seq", 0)):
            t = getattr(self, name)
            if t is not None:
                setattr(self, name, apply(t, dim))
        self.batch_size = self.win.shape[1]
        self._bind_step_storage()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        idx = beam_idx.to(self.device) if self.is_initialized else beam_idx
        self._batch_apply(lambda t: t.index_select(0, idx), in_place=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.fixed_capacity:
            raise NotImplementedError("StaticOscarCache has a fixed batch size; build it after expanding the batch")
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0), in_place=False)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.fixed_capacity:
            raise NotImplementedError("StaticOscarCache has a fixed batch size")
        self._batch_apply(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices],
                          in_place=False)

    # ------------------------------------------------------------------ persistence (the eager layer's format)
    def _window_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """``[2, B, Hk, n, D]`` (keys, values): the rows of ``slots [n]`` (``< T``) from the window: the ring while it
        holds them, else row ``b``'s sink; zeros for what neither holds (padding below a row's sink)."""
        s0, t = self.config.sink, self.host_len
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
        """The state in :class:`OscarLayer`'s saved form (:mod:`.io`): positions and the used part of each buffer."""
        s0, w, t, dev = self.config.sink, self.config.recent, self.host_len, self.device
        self._demote_pending(t)
        ts = t - w if t - w > s0 else 0
        n = max(0, ts - s0)
        tail = self._window_rows(torch.arange(ts, t, device=dev))  # [2, B, Hk, t - ts, D]
        state = dict(seq_len=t, tail_start=ts, pad=self.pad.clone(), sink_k=self.win_k[:, :, :s0], sink_v=self.win_v[:, :, :s0],
                     tail_k=tail[0], tail_v=tail[1], hist_k=QuantizedRows(*(x[:, :, :n] for x in self.hist_k)),
                     hist_v=QuantizedRows(*(x[:, :, :n] for x in self.hist_v)), mu_k_seq=self.mu_k_seq)
        if self.fp_heads:
            # the eager layer keeps every slot [0, t) of the retrieval heads coded: slots [S0, ts) are the coded
            # history as stored, the others are coded from the window (the same codes: each token and head is coded
            # alone); slots [0, S0) below a history are never read, coded from the window as far as it holds them
            front = self._window_rows(torch.arange(min(s0, ts), device=dev))  # [2, B, Hk, min(S0, ts), D]
            for i, (kind, coded) in enumerate((("k", self.coded_k), ("v", self.coded_v))):
                parts = zip(self.params.encode_coded(front[i]), (x[:, :, :n] for x in coded),
                            self.params.encode_coded(tail[i]))
                state[f"fp_{kind}"] = tuple(torch.cat(p, 2) for p in parts)  # [B, P, t, *]
        return state

    def import_state(self, state: dict) -> None:
        """Load :meth:`export_state`'s form (tensors on this layer's device, shapes checked by :mod:`.io`)."""
        s0, t, ts = self.config.sink, int(state["seq_len"]), int(state["tail_start"])
        tail_k = state["tail_k"]
        self.host_len = 0
        self.lazy_initialization(tail_k[:, :, :0], state["tail_v"][:, :, :0])
        self.advance(t)
        self.pad.copy_(state["pad"])
        self.pad_known = True
        self.win_k[:, :, :s0] = state["sink_k"]
        self.win_v[:, :, :s0] = state["sink_v"]
        first = max(ts, t - self.ring)
        idx = ring_entries(torch.arange(first, t, device=self.device), s0, self.ring)
        self.win_k.index_copy_(2, idx, tail_k[:, :, first - ts :])
        self.win_v.index_copy_(2, idx, state["tail_v"][:, :, first - ts :])
        for dst, src in ((self.hist_k, state["hist_k"]), (self.hist_v, state["hist_v"])):
            for a, x in zip(dst, src):
                a[:, :, : x.shape[2]] = x
        if self.fp_heads:  # the retrieval heads' history entries: slots [S0, ts) of the saved every-slot form
            n = max(0, ts - s0)
            for store, saved in ((self.coded_k, state["fp_k"]), (self.coded_v, state["fp_v"])):
                for dst, src in zip(store, saved):
                    dst[:, :, :n] = src[:, :, s0 : s0 + n]
        if state.get("mu_k_seq") is not None:
            self.mu_k_seq = _static(state["mu_k_seq"].float().contiguous())
        if ts > s0:  # the ring also holds the slot before the window (a decode step re-demotes it): from its codes
            self._refill_ring(ts - 1, ts)
        self.length.fill_(t)

    # ------------------------------------------------------------------ accounting
    def memory(self) -> dict[str, int]:
        """Bytes used by the cached tokens (logical, as ``OscarLayer.memory``, but for the retrieval heads, whose
        coded rows are history entries only: their sink and recent tokens are the window's) and allocated."""
        if not self.is_initialized:
            return dict(self.EMPTY_MEMORY)
        s0 = self.config.sink
        t = torch.tensor(self.host_len, device=self.device)
        mask = self.window_mask(t, self.config.recent)
        n_sink, n_rec = int(mask[:, :s0].sum()), int(mask[:, s0:].sum())
        n_hist = int((self.n_hist(t) - self.pad).clamp(min=0).sum())
        bufs = [t for t in (self.win, self.codes, self.meta, self.coded_x, self.coded_meta) if t is not None]
        return self.memory_from_counts(n_sink, n_rec, n_hist, n_hist, bufs)
