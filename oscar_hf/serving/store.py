"""`OscarPagedStore`: the OSCAR KV of every live request of a server: per request a BF16 sink + recent window, and
its INT2 history in pages of one shared :class:`~oscar_hf.serving.pool.PagedInt2Pool`.

Per request ``r`` and quantized layer, with ``S0 = sink``, ``W = recent``, ``T`` tokens seen (no padding: every
request is its own sequence), the same split as :class:`~oscar_hf.cache.dynamic.OscarLayer` with one row:

* sink ``[1, Hk, S0, D]`` (model dtype): slots ``[0, S0)``;
* history: slots ``[S0, tail_start)`` as entries ``j = slot - S0`` of the request's pages (block table shared by its
  layers: page ``table[j // P]`` holds entries ``[P * (j // P), P * (j // P + 1))`` of every layer);
* tail ``[1, Hk, T - tail_start, D]`` (model dtype): the recent slots ``[tail_start, T)``; nothing is quantized
  while ``T - W <= S0`` (then the tail holds every slot and the read is exact attention).

A forward of ``L`` new tokens first reads (sink + history + tail + the new rows, :meth:`OscarPagedStore.attend`)
then commits: the slots leaving the recent window are demoted (rotated, centered, clipped, INT2) into the
request's *current* page (a new page is taken from the pool when the current one is full). Requests join with
their first forward and leave with :meth:`OscarPagedStore.free`, which gives their pages back.

This is the CPU reference: the windows are per-request tensors and the demotion a torch call per request. The GPU
layout (windows as slots of a preallocated window pool, demotion fused into one launch over the batch) is in
docs/serving.md.
"""
from __future__ import annotations

import dataclasses

import torch

from oscar_hf.kernels.write_path import rotate_quantize

from ..cache import resolve_full_precision_heads
from ..cache.base import check_first_keys, group_queries, mask_rows
from ..cache.dynamic import slot_rows
from ..config import FULL_LAYER_TYPES, ModelFingerprint, OscarConfig, validate_head_dim
from ..patching import base_attention_function
from ..rotations import LayerRotation, OscarRotations
from .paged_attention import paged_decode_attention
from .pool import PagedInt2Pool, page_bytes


@dataclasses.dataclass
class LayerWindow:
    """One request's full-precision part of one layer, and how far it has been committed."""

    sink_k: torch.Tensor  # [1, Hk, S0, D]
    sink_v: torch.Tensor
    tail_k: torch.Tensor  # [1, Hk, T - tail_start, D]: slots [tail_start, T)
    tail_v: torch.Tensor
    seq_len: int = 0  # T
    tail_start: int = 0


@dataclasses.dataclass
class RequestKV:
    """One live request: its block table (history pages, shared by its layers) and one window per quantized layer."""

    table: list[int]
    layers: dict[int, LayerWindow]

    def length(self) -> int:
        return max((w.seq_len for w in self.layers.values()), default=0)


@dataclasses.dataclass(frozen=True)
class LayerParams:
    """What the write and read paths of one layer need: rotations and offsets on the store's device, clip ratios."""

    r_k: torch.Tensor  # [Hk, D, D] float32
    r_v: torch.Tensor
    mu_k: torch.Tensor | None  # [Hk, D] or None
    mu_v: torch.Tensor | None
    clip_k: float
    clip_v: float

    @classmethod
    def build(cls, config: OscarConfig, rotation: LayerRotation, layer_idx: int, device) -> "LayerParams":
        r = rotation.to(device)
        centered = config.center and (r.mu_k is not None or r.mu_v is not None)
        return cls(r.r_k, r.r_v, r.mu_k if centered else None, r.mu_v if centered else None,
                   config.clip_for("k", layer_idx, rotation.clip_k), config.clip_for("v", layer_idx, rotation.clip_v))


class OscarPagedStore:
    """The paged OSCAR KV store of a server (see the module docstring).

    ``OscarPagedStore(model_or_config, rotations=None, config=None, *, num_pages=None, memory_budget=None,
    page_size=256, device="cpu", dtype=torch.float32, **overrides)``: ``rotations`` an :class:`OscarRotations` or
    None for the artifact-free ``method``; ``overrides`` are :class:`OscarConfig` fields. The pool holds
    ``num_pages`` pages, or as many as ``memory_budget`` bytes pay for; with ``defer_pool=True`` it has no pool until
    :meth:`attach_pool` (what :func:`~oscar_hf.serving.paged_oscar` does: the pool then lives in Transformers' paged
    cache tensor, sized by its scheduler). Layers the store does not quantize (``skip_layers``, sliding-window layers)
    are left to Transformers' own paged cache (:meth:`handles`)."""

    def __init__(self, model_or_config, rotations: OscarRotations | None = None, config: OscarConfig | None = None, *,
                 num_pages: int | None = None, memory_budget: int | None = None, page_size: int = 256,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, defer_pool: bool = False,
                 **overrides):
        config = OscarConfig.build(config, None, **overrides)
        model_config = getattr(model_or_config, "config", model_or_config)
        if rotations is None:
            rotations = OscarRotations.builtin(model_config, config.method)
        else:
            rotations.check_compatible(model_config)
        fp = ModelFingerprint.from_config(model_config)
        config = config.for_head_dim(fp.head_dim)
        validate_head_dim(fp, config.group_size)
        if config.key_offset != "calibrated":
            raise NotImplementedError("the paged OSCAR store supports key_offset='calibrated' only")
        skipped = config.skipped(fp.num_layers)
        if resolve_full_precision_heads(config, rotations, fp, skipped):
            raise NotImplementedError("the paged OSCAR store does not keep full-precision heads yet; pass "
                                      "full_precision_heads=()")
        self.config, self.device, self.dtype = config, torch.device(device), dtype
        self.num_kv_heads, self.head_dim = fp.num_key_value_heads, fp.head_dim
        layers = [i for i, t in enumerate(fp.layer_types)
                  if t in FULL_LAYER_TYPES and i not in skipped and i in rotations.layers]
        if not layers:
            raise ValueError("the model has no layer OSCAR quantizes (full attention, with rotations, not skipped)")
        self.layer_slot = {layer: k for k, layer in enumerate(layers)}  # model layer -> pool layer index
        self.params = {i: LayerParams.build(config, rotations.layers[i], i, self.device) for i in layers}
        self._rotations_cpu = {i: rotations.layers[i] for i in layers}
        self.requests: dict[str, RequestKV] = {}
        self.pool: PagedInt2Pool | None = None
        self.pool_in_cache = False  # set by OscarPagedCache when the pool is laid out in Transformers' cache tensor
        if defer_pool:
            if num_pages is not None or memory_budget is not None:
                raise ValueError("defer_pool=True: the pool is sized when attached; drop num_pages / memory_budget")
            return
        if num_pages is None:
            if memory_budget is None:
                raise ValueError("give the pool's size: num_pages= or memory_budget= (bytes), or defer_pool=True")
            num_pages = int(memory_budget) // self.page_bytes(page_size)
        elif memory_budget is not None:
            raise ValueError("pass num_pages= or memory_budget=, not both")
        self.attach_pool(num_pages, page_size)

    # ------------------------------------------------------------------ sizes
    @property
    def num_layers(self) -> int:
        """Layers the store quantizes."""
        return len(self.layer_slot)

    def page_bytes(self, page_size: int, num_layers: int | None = None) -> int:
        """Bytes of one INT2 page of ``page_size`` history entries, keys and values of ``num_layers`` layers (default:
        every quantized layer)."""
        return page_bytes(self.num_layers if num_layers is None else num_layers, self.num_kv_heads, self.head_dim,
                          page_size, self.config.group_size, self.config.torch_meta_dtype)

    def window_tokens(self) -> int:
        """Full-precision slots a request keeps per layer once it is longer than the window: sink + recent."""
        return self.config.sink + self.config.recent

    def window_bytes_per_request(self) -> int:
        """Bytes of one request's full-precision sink + recent window over every quantized layer (keys and values)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.window_tokens() * self.head_dim * elem

    def history_pages(self, length: int, page_size: int) -> int:
        """INT2 pages a request of ``length`` tokens holds: its history entries ``[S0, length - W)``."""
        n = length - self.window_tokens()
        return -(-n // page_size) if n > 0 else 0

    def attach_pool(self, num_pages: int, page_size: int, storage: torch.Tensor | None = None) -> PagedInt2Pool:
        """(Re)build the INT2 page pool: ``num_pages`` pages of ``page_size`` entries, in ``storage`` (flat uint8, see
        :class:`PagedInt2Pool`) or in tensors of its own. Only while no request is live."""
        if self.requests:
            raise RuntimeError(f"the store still holds {len(self.requests)} requests; free them before a new pool")
        self.pool = PagedInt2Pool(num_pages, self.num_layers, self.num_kv_heads, self.head_dim, page_size,
                                  self.config.group_size, self.config.torch_meta_dtype, self.device, storage=storage)
        return self.pool

    # ------------------------------------------------------------------ requests
    def handles(self, layer_idx: int) -> bool:
        return layer_idx in self.layer_slot

    def length(self, request_id: str) -> int:
        r = self.requests.get(request_id)
        return 0 if r is None else r.length()

    def free(self, request_id: str) -> None:
        """The request leaves: its pages go back to the pool (shared ones when their last holder leaves)."""
        r = self.requests.pop(request_id, None)
        if r is not None:
            for page in r.table:
                self.pool.release(page)

    def free_all(self) -> None:
        for rid in list(self.requests):
            self.free(rid)

    def _window(self, request_id: str, layer_idx: int, past_length: int, new_k: torch.Tensor) -> LayerWindow:
        if self.pool is None:
            raise RuntimeError("the OSCAR store has no page pool yet (defer_pool=True and no attach_pool)")
        r = self.requests.get(request_id)
        if r is None:
            if past_length != 0:
                raise NotImplementedError(
                    f"request {request_id!r} starts at position {past_length}: its first {past_length} tokens were "
                    "never written to the OSCAR store (prefix sharing or a CPU-offload restore, which the paged "
                    "OSCAR store does not follow)")
            r = self.requests[request_id] = RequestKV(table=[], layers={})
        w = r.layers.get(layer_idx)
        if w is None:
            check_first_keys(layer_idx, self._rotations_cpu[layer_idx], new_k)
            if new_k.dtype != self.dtype or new_k.device != self.device:
                raise ValueError(f"the OSCAR store holds {self.dtype} on {self.device}, got {new_k.dtype} on "
                                 f"{new_k.device}")
            hk, d, s0 = self.num_kv_heads, self.head_dim, self.config.sink
            z = lambda n: torch.zeros(1, hk, n, d, dtype=self.dtype, device=self.device)  # noqa: E731
            w = r.layers[layer_idx] = LayerWindow(z(s0), z(s0), z(0), z(0))
        if w.seq_len != past_length:
            raise RuntimeError(f"request {request_id!r} layer {layer_idx}: the store holds {w.seq_len} tokens, the "
                               f"batch says {past_length}")
        return w

    # ------------------------------------------------------------------ read
    def attend(self, request_id: str, layer_idx: int, past_length: int, query: torch.Tensor, new_k: torch.Tensor,
               new_v: torch.Tensor, scaling: float, module, base: str) -> torch.Tensor:
        """``[1, L, Hq, D]``: one request's attention for one layer: ``query [1, Hq, L, D]`` over its cache plus the
        new rows ``new_k/new_v [1, Hk, L, D]`` (causal among themselves), which are then committed."""
        w = self._window(request_id, layer_idx, past_length, new_k)
        _, hq, l, d = query.shape
        hk = new_k.shape[1]
        g = hq // hk
        t_old = w.seq_len
        if w.tail_start == 0:
            # Nothing quantized yet: exact attention over every slot, as OscarLayer / DynamicCache compute it.
            keys = torch.cat([w.tail_k, new_k], 2)
            values = torch.cat([w.tail_v, new_v], 2)
            mask = None
            if t_old > 0 and l > 1:  # a chunk after earlier tokens: causal, aligned at the bottom right
                slot = torch.arange(t_old + l, device=query.device)
                mask = (slot[None, :] <= (t_old + torch.arange(l, device=query.device))[:, None])[None, None]
            out, _ = base_attention_function(module, base)(module, query, keys, values, mask, scaling=scaling,
                                                           dropout=0.0)
            self._commit(request_id, layer_idx, w, new_k, new_v)
            return out

        qf = group_queries(query.float(), hk)  # [1, Hk, M, D], M = g * L
        win_k = torch.cat([w.sink_k, w.tail_k, new_k], 2)  # [1, Hk, S0 + (T - tail_start) + L, D]
        win_v = torch.cat([w.sink_v, w.tail_v, new_v], 2)
        win_mask = None
        if l > 1:  # causal among the new rows; sink and older tail slots are all visible
            s0 = self.config.sink
            slot = torch.arange(w.tail_start, t_old + l, device=query.device)
            tail_ok = slot[None, :] <= (t_old + torch.arange(l, device=query.device))[:, None]  # [L, tail + L]
            ok = torch.cat([tail_ok.new_ones(l, s0), tail_ok], -1)[None]  # [1, L, window]
            win_mask = mask_rows(ok, g)  # [1, 1, M, window]
        p = self.params[layer_idx]
        r = self.requests[request_id]
        out = paged_decode_attention(qf, p.r_k, p.mu_k, self.pool, r.table, self.layer_slot[layer_idx],
                                     w.tail_start - self.config.sink, scaling, win_k, win_v, win_mask, p.r_v, p.mu_v,
                                     out_dtype=query.dtype, block_n=self.config.block_size)
        out = out.reshape(1, hq, l, d).transpose(1, 2).contiguous()
        self._commit(request_id, layer_idx, w, new_k, new_v)
        return out

    # ------------------------------------------------------------------ write
    def _recent_start(self, t: int) -> int:
        s0, wr = self.config.sink, self.config.recent
        return t - wr if t - wr > s0 else 0

    def _commit(self, request_id: str, layer_idx: int, w: LayerWindow, new_k, new_v) -> None:
        """Append ``new_k/v [1, Hk, L, D]`` (slots ``[T, T + L)``) and demote what left the recent window."""
        t_new = w.seq_len + new_k.shape[2]
        target = max(self._recent_start(t_new), w.tail_start)
        if target > w.tail_start:
            self._demote(request_id, layer_idx, w, w.tail_start, target, new_k, new_v)
        keep = target - w.tail_start  # slots [tail_start, target) left the window
        w.tail_k = torch.cat([w.tail_k, new_k], 2)[:, :, keep:]
        w.tail_v = torch.cat([w.tail_v, new_v], 2)[:, :, keep:]
        w.tail_start, w.seq_len = target, t_new

    def _source(self, w: LayerWindow, a: int, b: int, new_k, new_v):
        """Rows of slots ``[a, b)`` (``a >= tail_start``) from the tail and/or the new rows, ``[1, Hk, b - a, D]``."""
        return slot_rows(w.tail_k, w.tail_v, w.tail_start, w.seq_len, a, b, new_k, new_v)

    def _demote(self, request_id: str, layer_idx: int, w: LayerWindow, a: int, b: int, new_k, new_v) -> None:
        """Slots ``[a, b)`` leave the window: ``[a, S0)`` into the sink, ``[S0, b)`` quantized into the history
        pages (the current page first; new pages from the pool as entries cross a page boundary)."""
        s0, cfg = self.config.sink, self.config
        if a < s0:
            src_k, src_v = self._source(w, a, min(b, s0), new_k, new_v)
            w.sink_k[:, :, a : min(b, s0)] = src_k
            w.sink_v[:, :, a : min(b, s0)] = src_v
        ha = max(a, s0)
        if b <= ha:
            return
        r = self.requests[request_id]
        pages_needed = -(-(b - s0) // self.pool.page_size)
        while len(r.table) < pages_needed:  # the first layer to cross a page boundary takes the page for all layers
            r.table.append(self.pool.allocate())
        p, slot = self.params[layer_idx], self.layer_slot[layer_idx]
        meta = cfg.torch_meta_dtype
        for c0 in range(ha, b, cfg.prefill_chunk):
            c1 = min(b, c0 + cfg.prefill_chunk)
            xk, xv = self._source(w, c0, c1, new_k, new_v)
            qk = rotate_quantize(xk, p.r_k, p.mu_k, p.clip_k, cfg.group_size, meta, use_kernels=cfg.use_kernels)
            qv = rotate_quantize(xv, p.r_v, p.mu_v, p.clip_v, cfg.group_size, meta, use_kernels=cfg.use_kernels)
            self.pool.write(r.table, slot, "k", c0 - s0, qk)
            self.pool.write(r.table, slot, "v", c0 - s0, qv)

    # ------------------------------------------------------------------ accounting
    def window_bytes(self) -> int:
        """Bytes of the live requests' full-precision sinks and tails."""
        return sum(t.numel() * t.element_size() for r in self.requests.values() for w in r.layers.values()
                   for t in (w.sink_k, w.sink_v, w.tail_k, w.tail_v))

    def stats(self) -> dict[str, int]:
        if self.pool is None:
            return dict(requests=0, pages_used=0, pages_free=0, history_bytes=0, window_bytes=0)
        return dict(requests=len(self.requests), pages_used=self.pool.num_used, pages_free=self.pool.num_free,
                    history_bytes=self.pool.num_used * self.pool.bytes_per_page, window_bytes=self.window_bytes())
