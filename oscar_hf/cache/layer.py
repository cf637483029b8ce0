"""`OscarLayer`: a quantized layer in fixed-address device buffers, in the serving store's layout (:mod:`.window`),
so that ``generate`` can compile its decode step; run eagerly (``OscarCache(compile=False)``, the CPU) it is the same
storage. `GrowingLayer`: a full-precision layer of the compiled storage, growing in the same capacity buckets. The
buffers and their shapes (``win``, ``codes``, ``meta``, ``coded_x``, ``coded_meta``, ``length``): docs/cache.md,
"The OSCAR layer".
"""
from __future__ import annotations

import math

import torch
from torch.compiler import is_compiling
from transformers.cache_utils import CacheLayerMixin

from oscar_hf.kernels.int2_attention import rotate_query
from oscar_hf.kernels.static_op import (NO_HEADS, decode_step, decode_step_, join_heads_index, split_heads_index,
                                        step_config, step_heads, step_storage)

from ..config import OscarConfig
from ..quant import QuantizedRows, rows_from
from ..rotations import LayerRotation
from . import heads
from .base import (LayerKV, QuantizedLayerBase, allowed_slots, check_first_keys, check_reference_storage,
                   first_real_slot, group_queries, logit_terms)
from .layer_eager import EagerOps, _fixed_address, regrown
from .params import LayerParams
from .step_shared import StepShared
from .window import window_mask

RING_RESERVE = 64  # ring entries beyond W + 1: crop(-n) is exact for n <= RING_RESERVE
BUCKET = 1024  # capacity granularity (slots)
HEADROOM = 1 / 8  # a fresh allocation leaves room for this fraction of its length (at least BUCKET slots) ...
GROWTH = 1.5  # ... and a full one grows by this factor: few buckets (CUDA graphs) over a long generation
RESERVE_FACTOR = 4  # generate's own length is allocated up front, up to this many times what ``need`` gets: an
# answer then fits without a growth (each re-records a CUDA graph), while a far-off max_length is not all reserved


def capacity_for(need: int, current: int = 0, expected: int = 0) -> int:
    """Slots to allocate for ``need`` tokens (``current``: the capacity when growing; ``expected``: the length
    ``generate`` will reach), rounded up to ``BUCKET``."""
    want = max(need + max(int(need * HEADROOM), BUCKET), int(current * GROWTH))
    if expected > want:
        want = min(expected, RESERVE_FACTOR * want)
    return int(math.ceil(want / BUCKET) * BUCKET)


class HostLength:
    """Host side of the compiled-storage layers: ``host_len`` (``T``, no device sync), capacity buckets, cache ops."""

    is_compileable = True
    is_croppable = True
    is_sliding = False

    def _init_length(self, max_cache_len: int | None) -> None:
        self.fixed_capacity = None if max_cache_len is None else int(max_cache_len)  # StaticOscarCache's: no growth
        self.length = torch.zeros((), dtype=torch.long)  # T on the device, 0-d int64
        self.capacity = self.host_len = 0
        self.expected_len = 0  # the length generate will reach (set by the compiled step's hook; 0: unknown)
        self.announced = False  # the compiled step's wrapper already counted this forward's token

    def _first_capacity(self, n: int) -> int:
        """The first allocation's capacity, for ``n`` new rows."""
        return self.fixed_capacity or capacity_for(max(self.host_len, n), 0, self.expected_len)

    def capacity_after(self, n: int) -> int:
        """The capacity once ``n`` more tokens are written (:meth:`advance`'s rule): the mask is built before. A
        decode step grows by GROWTH; a prefill chunk to its own need (no x1.5 overshoot per chunk)."""
        need = self.host_len + n
        if self.fixed_capacity:
            return self.fixed_capacity
        return self.capacity if need <= self.capacity else capacity_for(need, self.capacity if n == 1 else 0,
                                                                         self.expected_len)

    def advance(self, n: int) -> None:
        """Host side, before ``n`` new tokens are written: a bigger bucket when they would not fit."""
        if self.is_initialized and self.host_len + n > self.capacity:
            if self.fixed_capacity:
                raise ValueError(f"StaticOscarCache is full (max_cache_len={self.fixed_capacity}, "
                                 f"{self.host_len + n} tokens)")
            self._allocate(self.capacity_after(n))
        self.host_len += n

    def _count_rows(self, n: int) -> None:
        """An eager ``update``'s ``n`` rows, unless the compiled step's wrapper counted them (and this forward fell
        back to eager)."""
        if self.announced:
            self.announced = False
        else:
            self.advance(n)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        idx = beam_idx.to(self.device) if self.is_initialized else beam_idx
        self._batch_apply(lambda t: t.index_select(0, idx), in_place=True)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._batch_apply(lambda t: t.repeat_interleave(repeats, dim=0), in_place=False)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._batch_apply(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices],
                          in_place=False)

    def _batch_apply(self, fn, in_place: bool) -> None:
        """Apply ``fn`` (a batch-dim op) to every per-row buffer (``_BATCH_DIMS``: name, batch dimension), in place
        (keeps CUDA graphs' addresses) or not."""
        if not in_place and self.fixed_capacity:
            raise NotImplementedError("StaticOscarCache has a fixed batch size; build it after expanding the batch")
        if not self.is_initialized:
            return
        for name, dim in self._BATCH_DIMS:
            t = getattr(self, name)
            if t is not None:
                out = fn(t.movedim(dim, 0)).movedim(0, dim)
                setattr(self, name, t.copy_(out) if in_place else _fixed_address(out.contiguous()))
        self._rebatched()

    def _rebatched(self) -> None:
        """After :meth:`_batch_apply`: what follows the buffers."""

    def reset(self) -> None:
        """Every per-row buffer and the length zeroed in place (their addresses kept: CUDA graphs), ``T = 0``."""
        if self.is_initialized:
            for t in (self.length, *(getattr(self, name) for name, _ in self._BATCH_DIMS)):
                if t is not None:
                    t.zero_()
        self.host_len, self.announced = 0, False

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens: the slots above the new length are hidden by the mask and
        overwritten by the next writes (what else follows them: :meth:`_cropped`)."""
        if tokens_to_remove > 0:
            raise ValueError("OscarCache.crop takes a negative number of tokens to remove (transformers 5.x)")
        if tokens_to_remove and self.is_initialized:
            t_new = max(0, self.host_len + tokens_to_remove)
            self._cropped(t_new)
            self.host_len = t_new
            self.length.fill_(t_new)

    def _cropped(self, t_new: int) -> None:
        """Before :meth:`crop` moves the length from ``host_len`` back to ``t_new``: what follows the slots."""

    def get_seq_length(self):
        return self.length if is_compiling() else self.host_len  # inside the compiled step: no guard on a changing int

    def get_max_length(self) -> int:
        return self.fixed_capacity or -1


class OscarLayer(EagerOps, HostLength, QuantizedLayerBase):
    """One quantized layer with device-resident storage. ``max_cache_len`` fixes the capacity; None grows it.
    ``compiled``: ``generate`` compiles its decode step (fixed mask sizes); else every forward runs eagerly and reads
    the model's mask (any mask, as a ``DynamicLayer`` neighbour sizes it)."""

    def __init__(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, max_cache_len: int | None = None,
                 retrieval_heads=(), compiled: bool = False):
        super().__init__(config, rotation, layer_idx, retrieval_heads)
        self.compiled = compiled  # (OscarConfig keeps recent >= 1: the ring holds at least the last slot)
        self._init_length(max_cache_len)
        self.ring = config.recent + 1 + RING_RESERVE
        self.win = self.codes = self.meta = self.key_hi = self.value_meta = None  # the storage (lazy_initialization)
        self.coded_x = self.coded_meta = None
        self.advances_length = True
        self.pad_known = False  # Python flag: set at the first (eager) forward
        self.step = StepShared()  # replaced by the cache's one, shared by its layers
        self.pending = False  # (eager) update returned rows that attend has not consumed yet

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_first_keys(self.layer_idx, self._rotation_cpu, key_states)
        check_reference_storage(self.config, key_states)
        b, hk, _, d = key_states.shape
        self.batch_size, self.num_kv_heads, self.head_dim = b, hk, d
        self.dtype, self.device = key_states.dtype, key_states.device
        dev = self.device
        params = LayerParams.build(self.config, self._rotation_cpu, self.layer_idx, hk, self.retrieval_heads, dev)
        # Each tensor this layer's own: a step whose inputs alias (a Hadamard rotation shared by layers) loses its
        # fixed-address marks under CUDA graphs, which then skip the whole step
        self.params = params.with_tensors(lambda t: _fixed_address(t.clone()))
        # the INT2 heads' count: what the compiled step asks of params.int2_heads (one guard, not one per head)
        self.n_int2 = len(params.int2_heads)
        self.win = _fixed_address(torch.zeros(2, b, hk, self.config.sink + self.ring, d, dtype=self.dtype, device=dev))
        self.pad = _fixed_address(torch.zeros(b, dtype=torch.long, device=dev))
        self.length = self.step.join(self)
        self.heads_index = None
        if self.retrieval_heads:
            prm = self.params
            self.heads_index = _fixed_address(join_heads_index(prm.hist_of, prm.coded_of, prm.int2_idx, prm.coded_idx))
        self._allocate(self._first_capacity(key_states.shape[2]))
        self.is_initialized = True

    # One tensor per kind of storage, keys and values stacked (one input of the compiled step each); views:
    win_k = property(lambda self: self.win[0])  # [B, Hk, S0 + R, D]
    win_v = property(lambda self: self.win[1])
    hist_k = property(lambda self: self._hist(0))  # QuantizedRows [B, H2, N, *], or None
    hist_v = property(lambda self: self._hist(1))
    coded_k = property(lambda self: self._coded(0))  # the retrieval heads' parts [B, P, N, *], or None
    coded_v = property(lambda self: self._coded(1))

    def _hist(self, i: int) -> QuantizedRows | None:
        if self.codes is None:
            return None
        meta = self.meta[i] if i == 0 or self.value_meta is None else self.value_meta  # [2 (scale, zero), B, H2, N, *]
        parts = (self.codes[i], meta[0], meta[1])
        return rows_from(parts + (self.key_hi,) if i == 0 and self.key_hi is not None else parts)

    def _coded(self, i: int) -> tuple[torch.Tensor, ...] | None:
        if self.coded_x is None:
            return None
        return (self.coded_x[i],) if self.coded_meta is None else (self.coded_x[i], *self.coded_meta[i])

    def _allocate(self, capacity: int) -> None:
        """(Re)allocate the history buffers at ``capacity``, keeping their content."""
        b, d, dev = self.batch_size, self.head_dim, self.device
        g, gv, meta = self.config.group_size, self.config.value_group(self.head_dim), self.config.torch_meta_dtype
        hq, p = len(self.params.int2_heads), len(self.retrieval_heads)
        n = max(capacity - self.config.sink - self.config.recent, 1)  # history rows

        # codes [2 (K, V), B, H2, N, D/4]; meta [2 (K, V), 2 (scale, zero), B, H2, N, D/G]; 3-bit keys: their high
        # bit's plane key_hi [B, H2, N, D/8] (a tensor of its own: the values stay at D/4 bytes a row); values at a
        # group of their own: meta [1 (K), 2, B, H2, N, D/G] and value_meta [2 (scale, zero), B, H2, N, D/Gv]
        self.codes = regrown(self.codes, (2, b, hq, n, d // 4), torch.uint8, dev, dim=3)
        self.meta = regrown(self.meta, (2 if gv == g else 1, 2, b, hq, n, d // g), meta, dev, dim=4)
        if gv != g:
            self.value_meta = regrown(self.value_meta, (2, b, hq, n, d // gv), meta, dev, dim=3)
        if self.config.key_bits == 3:
            self.key_hi = regrown(self.key_hi, (b, hq, n, d // 8), torch.uint8, dev, dim=2)
        if p:  # coded_x [2, B, P, N, X] (codes, or the rows at 16 bits), coded_meta [2, 2, B, P, N, 1] (not at 16)
            (last, dt), *meta_spec = heads.part_specs(self.config.retrieval_bits, d, self.dtype)
            self.coded_x = regrown(self.coded_x, (2, b, p, n, last), dt, dev, dim=3)
            if meta_spec:
                self.coded_meta = regrown(self.coded_meta, (2, 2, b, p, n, 1), meta_spec[0][1], dev, dim=4)
        self.capacity = capacity
        self._bind_step_storage()

    def _bind_step_storage(self) -> None:
        """The decode op's arguments that change only with the buffers, rebuilt whenever one is replaced."""
        cfg, prm = self.config, self.params
        self.step_storage = step_storage(self.win, self.codes, self.meta, self.key_hi, self.value_meta, prm.r,
                                         prm.clip_k, prm.clip_v)
        self.step_heads = (step_heads(self.heads_index, self.coded_x, self.coded_meta) if self.retrieval_heads
                           else NO_HEADS)
        self.step.config = step_config(cfg.group_size, cfg.torch_meta_dtype, cfg.sink, cfg.recent, cfg.use_kernels,
                                       cfg.quantizer, cfg.retrieval_bits, cfg.block_size)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not is_compiling():
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self.pending:
                raise RuntimeError(
                    f"OscarCache layer {self.layer_idx}: update() was called again before the previous rows were "
                    "consumed by the 'oscar_*' attention function. The model's attention does not go through OSCAR: "
                    "build the cache with OscarCache(model, ...) / OscarCache.from_pretrained(path, model), or call "
                    "oscar_hf.enable_oscar(model).")
            self.check_update(key_states)
            self._count_rows(key_states.shape[2])
            self.pending = True
        handle = LayerKV(self, key_states, value_states)
        return handle, handle

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        # A compiled decode step reads no mask: one slot keeps the step's inputs of fixed shape. A fixed capacity keeps
        # StaticCache's full-size mask (a skipped layer may read it); eager, DynamicLayer's
        if self.compiled and self.fixed_capacity:
            return self.fixed_capacity, 0
        if self.compiled and query_length == 1:
            return 1, (0 if is_compiling() else self.host_len)
        return self.host_len + query_length, 0

    def reset(self) -> None:
        self.mu_k_seq, self.pad_known, self.pending = None, False, False  # (mu_k_seq dropped, not zeroed)
        super().reset()

    def attend(self, handle: LayerKV, query, attention_mask, scaling: float, module, base: str, **kwargs) -> torch.Tensor:
        """``query [B, Hq, L, D]`` -> ``[B, L, Hq, D]``. A decode step writes, then reads, device ops only;
        multi-token forwards (eager) read the old state + the new rows, then write."""
        new_k, new_v = handle.key_states, handle.value_states
        b, hq, l, d = query.shape
        t_old = None
        if not is_compiling():
            self.pending = False
            t_old = self.host_len - l
            if not self.pad_known:  # first forward of this cache: left padding from the mask
                self.pad.copy_(first_real_slot(allowed_slots(attention_mask, b, l, t_old, query.device)))
                self.pad_known = True
        # eager: while nothing is quantized (the model's own attention), or under a mask that hides more than left
        # padding, a decode step reads as a multi-token forward does
        if l > 1 or (not is_compiling() and not self.compiled and (
                t_old - self.config.recent <= self.config.sink or not self._left_padding_only(attention_mask, t_old))):
            return self._multi_token(query, new_k, new_v, attention_mask, scaling, module, base, t_old, **kwargs)
        # A decode step: the query's rotation in torch ops (one Inductor reduction kernel), the write and
        # the attention one opaque op (static_op.decode_step). t: the new token's slot
        softcap, sinks = logit_terms(kwargs, self.num_kv_heads, 1)
        t, pad, win_mask, hist_len = self._step_state()
        mu_k, mu_v = self.offsets()
        q = group_queries(query, self.num_kv_heads)  # [B, Hk, g, D]
        q_rot = qk_off = None
        if self.n_int2:  # [B, H2, g, D] float32, [B, H2, g]
            qi = q.float()
            if self.retrieval_heads:  # the INT2 heads' KV heads: a slice of the op's index, not one more input of the step
                int2_idx = split_heads_index(self.step_heads.heads_index, self.num_kv_heads, self.n_int2)[2]
                qi = qi.index_select(1, int2_idx)
            q_rot, qk_off = rotate_query(qi, self.params.r_k, mu_k, self.config.use_kernels)
            q_rot = q_rot.contiguous()
        # (NO_HEADS through its module global, not the layer's attribute: one set of guards for all such layers)
        args = (q, q_rot, qk_off, new_k.detach(), new_v.detach(), t, pad, win_mask, hist_len, mu_k, mu_v,
                float(scaling), query.dtype, sinks, float(softcap or 0.0), *self.step_storage,
                *(self.step_heads if self.retrieval_heads else NO_HEADS), *self.step.config)
        # the opaque op while torch.compile traces, the function in eager code
        out = decode_step_(*args) if is_compiling() else decode_step(*args)
        if self.advances_length:  # the last layer of its device: once for all of them
            t.add_(1)
        if self.step.last_layer is None or self.layer_idx >= self.step.last_layer:
            self.step.clear()
        return out.reshape(b, hq, 1, d).transpose(1, 2).contiguous()

    def _step_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(t 0-d, pad [B], win_mask [B, 1, 1, S0 + R], hist_len 0-d)`` of a decode step (:class:`StepShared`)."""
        step, key = self.step, (self.config.sink, self.ring, self.config.recent, self.batch_size, self.device)
        if step.key != key or self.layer_idx <= step.layer_idx:
            step.t, step.pad = self.length, self.pad
            step.win_mask = self.window_mask(self.length + 1, self.config.recent + 1)[:, None, None, :]
            step.hist_len, step.key = self.n_hist(self.length), key
        step.layer_idx = self.layer_idx
        return step.t, step.pad, step.win_mask, step.hist_len

    def n_hist(self, length: torch.Tensor) -> torch.Tensor:
        return (length - self.config.recent - self.config.sink).clamp(min=0)

    def window_mask(self, length: torch.Tensor, recent: int) -> torch.Tensor:
        """``[B, S0 + R]`` bool: :func:`window_mask` of every row at ``length`` (0-d) from its left padding."""
        return window_mask(length, self.pad, self.config.sink, self.ring, recent)


class GrowingLayer(HostLength, CacheLayerMixin):
    """The compiled storage's ``DynamicLayer`` (skipped layers, MLA latents, KV sharing's store layers), so that
    such a model compiles without a ``max_cache_len``. ``keys [B, H, C, Dk]``, ``values [B, H, C, Dv]``, slot =
    position. A decode step gets all ``C`` slots (the ``(C, 0)`` mask hides the unwritten), a multi-token forward
    the ``T`` written ones."""

    supports_early_init = False
    _BATCH_DIMS = (("keys", 0), ("values", 0))

    def __init__(self, max_cache_len: int | None = None, **kwargs):
        super().__init__()
        self._init_length(max_cache_len)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.length = _fixed_address(torch.zeros((), dtype=torch.long, device=self.device))
        self.keys, self.values = key_states[:, :, :0], value_states[:, :, :0]
        self._allocate(self._first_capacity(key_states.shape[2]))
        self.is_initialized = True

    def _allocate(self, capacity: int) -> None:
        # [B, H, C_old, D] -> [B, H, capacity, D], content kept
        self.keys, self.values = (regrown(t, (*t.shape[:2], capacity, t.shape[3]), t.dtype, t.device, dim=2)
                                  for t in (self.keys, self.values))
        self.capacity = capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        l = key_states.shape[2]
        if not is_compiling():
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if key_states.shape[0] != self.keys.shape[0]:
                raise ValueError(f"OscarCache full-precision layer holds batch size {self.keys.shape[0]}, got "
                                 f"{key_states.shape[0]} rows (use batch_repeat_interleave / batch_select_indices)")
            self._count_rows(l)
        idx = self.length + torch.arange(l, device=self.device)  # [L] slots of the new rows
        self.keys.index_copy_(2, idx, key_states)
        self.values.index_copy_(2, idx, value_states)
        self.length.add_(l)
        if is_compiling() or l == 1:  # all C slots: a decode step's shapes stay fixed (its mask hides the unwritten ones)
            return self.keys, self.values
        # a multi-token forward reads the written slots only, as DynamicLayer: the model may skip its mask there
        return self.used()

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        if is_compiling():
            return self.capacity, 0
        return (self.capacity_after(1) if query_length == 1 else self.host_len + query_length), 0

    def used(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(keys, values)`` of the slots written, ``[B, H, T, D]`` views."""
        return self.keys[:, :, : self.host_len], self.values[:, :, : self.host_len]
