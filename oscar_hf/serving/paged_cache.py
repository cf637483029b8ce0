"""OSCAR inside Transformers' continuous batching (``model.generate_batch``, ``ContinuousBatchingManager``).

How continuous batching runs a step (Transformers 5.2x, read off ``generation/continuous_batching``): the scheduler
picks requests; ``ContinuousBatchingIOs.prepare_batch_tensors`` packs their new tokens into one row
``input_ids [1, sum L_i]`` and calls ``cache.extend_read_and_write_indices(request_id, past_length, query_length,
...)`` for each request in order; the model forward gets ``cache=<PagedAttentionCache>`` plus ``cu_seq_lens_q``,
``read_index``, ``write_index`` and a block-diagonal 4D mask; every attention module calls
``cache.update(k, v, layer_idx, kwargs=kwargs)`` and hands what it returns to ``ALL_ATTENTION_FUNCTIONS[name]``.

Where OSCAR plugs in, with no change to Transformers:

* :class:`OscarPagedCache` subclasses ``PagedAttentionCache``. It records the batch's ``(request_id, past_length,
  query_length)`` from ``extend_read_and_write_indices`` (the request ids never reach the forward otherwise), and
  its ``update`` returns a :class:`PagedOscarKV` handle for the layers the store quantizes (the others take the
  BF16 paged path unchanged). ``free_blocks`` / ``reset`` also free the store.
* The handle is an :class:`oscar_hf.attention.OscarKV`, so the project's registered ``oscar_<base>`` attention
  (``oscar_sdpa``) serves it: one registration route for ``generate`` and for continuous batching.
* The manager builds its cache inside ``_create_batch_processor`` from the module global
  ``continuous_api.PagedAttentionCache`` and refuses attention names other than ``sdpa`` / ``paged|eager`` / flash
  at construction: :func:`paged_oscar` swaps that global for the duration of a ``with`` block and switches the
  model to ``oscar_sdpa`` once the manager has accepted ``sdpa``. That swap is the one monkey-patch.

Memory: when the store quantizes every layer of the model (all full attention, none skipped), Transformers allocates
no BF16 K/V at all. While :class:`OscarPagedCache` is constructed, the ``"full_attention"`` allocator is
:class:`OscarCacheAllocator` (a block = one INT2 page per layer; a request holds the pages of its history plus a fixed
number of blocks paying for its full-precision window) and the memory handler is :class:`OscarMemoryHandler` (no
BF16 read-back or ``[M, N + M]`` mask per cache token), so the flat cache tensor Transformers sizes from
``num_blocks`` / ``max_memory_percent`` holds INT2 pages, and the store's page pool is laid out in that tensor. The
scheduler's admission (``can_store_request_tokens``) then counts OSCAR bytes. Models with layers the store leaves to
Transformers (sliding windows, ``skip_layers``) keep Transformers' BF16 cache and a separately sized pool.

Not followed (refused loudly): prefix sharing (block sharing is turned off), forks (``num_return_sequences > 1``),
CPU offloading, CUDA graphs / compile (the read loops over requests in Python). See docs/serving.md.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from transformers.generation.continuous_batching import cache as cache_module
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import (
    ATTN_TYPE_TO_ALLOCATOR,
    PagedAttentionCache,
    PagedAttentionMemoryHandler,
    group_layers_by_attn_type,
)
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator

from ..attention import OscarKV, disable_oscar, enable_oscar
from .store import OscarPagedStore


class PagedOscarKV(OscarKV):
    """What :meth:`OscarPagedCache.update` returns for a quantized layer: the packed new rows of every request of the
    batch (``key_states/value_states [1, Hk, sum L_i, D]``) and the batch's requests in packing order."""

    __slots__ = ("store", "layer_idx", "batch")

    def __init__(self, store: OscarPagedStore, layer_idx: int, key_states, value_states, batch):
        super().__init__(None, key_states, value_states)
        self.store, self.layer_idx, self.batch = store, layer_idx, batch

    @property
    def shape(self):
        b, h, l, d = self.key_states.shape
        return torch.Size((b, h, l + sum(past for _, past, _ in self.batch), d))

    def attend(self, query, attention_mask, scaling: float, module, base: str, **kwargs) -> torch.Tensor:
        """``[1, sum L_i, Hq, D]``: each request's rows attend to that request's cache only (the block-diagonal mask
        continuous batching builds is implied by the per-request loop, so it is not read)."""
        cu = kwargs.get("cu_seq_lens_q")
        total = sum(q for _, _, q in self.batch)
        if total != query.shape[2]:
            raise RuntimeError(f"OSCAR paged attention: the batch holds {total} new tokens, the query {query.shape[2]} "
                               "(padded batches: CUDA graphs / compile are not supported)")
        if cu is not None and int(cu[len(self.batch)]) != total:
            raise RuntimeError("OSCAR paged attention: cu_seq_lens_q disagrees with the recorded batch")
        outs, start = [], 0
        for request_id, past, q_len in self.batch:
            sl = slice(start, start + q_len)
            outs.append(self.store.attend(request_id, self.layer_idx, past, query[:, :, sl], self.key_states[:, :, sl],
                                          self.value_states[:, :, sl], scaling, module, base))
            start += q_len
        return torch.cat(outs, 1)


class OscarCacheAllocator(FullAttentionCacheAllocator):
    """Transformers' block accounting for the layers the store quantizes, without their BF16 K/V.

    A block is one INT2 page (``page_size`` history entries, keys and values) of every quantized layer:
    ``bytes_per_page`` is the INT2 page of one layer, so sectors, ``num_blocks`` and the memory budget count INT2
    bytes. A request of ``T`` tokens holds ``window_blocks + ceil((T - S0 - W) / P)`` blocks: its history pages (the
    store's own count) plus a constant that pays for its full-precision sink + recent window. The blocks are
    bookkeeping only: the store writes its pages through its own free list in the same memory (``num_blocks`` pages),
    and holds at most as many pages as Transformers has handed out. Nothing here is read by the attention, so no
    read / write indices are produced and the keys each request attends to count as its new rows only (the
    ``[sum L, sum L]`` mask Transformers builds for sdpa is not read either). Bound to a store by :meth:`bind`."""

    supports_block_sharing = False  # prefix sharing is not followed
    supports_block_table = False  # no flash decode fast path
    store: OscarPagedStore  # set on the bound subclass

    @classmethod
    def bind(cls, store: OscarPagedStore) -> type:
        """A subclass whose sizes come from ``store`` (Transformers builds allocators and calls
        ``get_bytes_per_page`` on the class, before any instance exists)."""
        return type("BoundOscarCacheAllocator", (cls,), {"store": store})

    @classmethod
    def get_bytes_per_page(cls, num_key_value_heads: int, head_dim: int, cache_dtype: torch.dtype,
                           page_size: int) -> int:
        if (num_key_value_heads, head_dim) != (cls.store.num_kv_heads, cls.store.head_dim):
            raise NotImplementedError(f"the OSCAR paged cache holds {cls.store.num_kv_heads} KV heads of "
                                      f"{cls.store.head_dim}; Transformers asks for {num_key_value_heads} of "
                                      f"{head_dim} "
                                      "(tensor parallelism is not followed)")
        return cls.store.page_bytes(page_size, num_layers=1)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Window bytes of one request, paid in blocks: [S0 + W slots x layers x K,V] in the model dtype.
        self.window_blocks = -(-self.store.window_bytes_per_request() // self.bytes_per_block)

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self.bytes_per_sector = bytes_per_sector
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)  # no BF16 views

    def _compute_blocks_needed(self, allocated_blocks: int, past_length: int, query_length: int) -> int:
        p = self.tokens_per_page
        total = self.window_blocks + self.store.history_pages(past_length + query_length, p)
        return max(0, total - allocated_blocks)

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        return query_length

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    def get_write_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    def update(self, *args, **kwargs):
        raise RuntimeError("OSCAR layers are served by OscarPagedCache.update, not the allocator")

    def get_cache_for_block_table(self, layer_idx: int):
        raise NotImplementedError("the OSCAR paged cache does not serve the flash block-table decode path")

    def copy_blocks(self, source_block_ids, dest_block_ids) -> None:
        raise NotImplementedError("the OSCAR paged cache does not copy blocks (forks)")


class OscarMemoryHandler(PagedAttentionMemoryHandler):
    """Transformers' sizing of the cache when every layer is OSCAR's: a cache token costs its INT2 share of a sector
    only (no BF16 read-back at the attention peak, no read index), and the sdpa masks are ``[M, M]`` (each request's
    keys are its new rows for Transformers; the store reads the past)."""

    @property
    def bytes_per_cache_token(self) -> int:
        return 0

    def attention_mask_bytes(self, max_batch_tokens: int, num_sectors: int) -> int:
        a = self.activation_dtype.itemsize
        return self.io_multiplier * self.num_attention_masks * a * max_batch_tokens**2


def store_owns_every_layer(store: OscarPagedStore, config) -> bool:
    """Whether the store quantizes every layer of ``config`` (then Transformers allocates no BF16 K/V)."""
    groups = group_layers_by_attn_type(config)
    full = FullAttentionCacheAllocator.layer_type
    return list(groups) == [full] and all(store.handles(i) for i in groups[full])


@contextlib.contextmanager
def _oscar_allocation(store: OscarPagedStore):
    """Inside: Transformers' cache construction uses the OSCAR allocator and memory handler (module globals of
    ``continuous_batching.cache``); restored on exit."""
    full = FullAttentionCacheAllocator.layer_type
    allocator = OscarCacheAllocator.bind(store)
    saved = (ATTN_TYPE_TO_ALLOCATOR[full], cache_module.FullAttentionCacheAllocator,
             cache_module.PagedAttentionMemoryHandler)
    ATTN_TYPE_TO_ALLOCATOR[full] = allocator
    cache_module.FullAttentionCacheAllocator = allocator  # the handler's bytes per block (num_blocks <-> bytes)
    cache_module.PagedAttentionMemoryHandler = OscarMemoryHandler
    try:
        yield
    finally:
        ATTN_TYPE_TO_ALLOCATOR[full], cache_module.FullAttentionCacheAllocator = saved[:2]
        cache_module.PagedAttentionMemoryHandler = saved[2]


class OscarPagedCache(PagedAttentionCache):
    """``PagedAttentionCache`` whose OSCAR layers live in an :class:`OscarPagedStore` (see the module docstring).
    Built by :func:`paged_oscar` in place of the manager's own cache, with the manager's arguments."""

    def __init__(self, *args, store: OscarPagedStore, **kwargs):
        if "kwargs" not in inspect.signature(PagedAttentionCache.update).parameters:
            raise NotImplementedError("this Transformers version runs the paged cache from its `paged|*` attention "
                                      "function (5.17 style); the OSCAR paged cache needs cache.update(..., kwargs)")
        config = args[0] if args else kwargs["config"]
        self.oscar_owns_memory = store_owns_every_layer(store, config)
        if not self.oscar_owns_memory:  # BF16 cache for the other layers, the store's pool sized by the user
            if store.pool is None:
                raise ValueError("this model has layers OSCAR does not quantize (sliding windows / skip_layers): its "
                                 "BF16 paged cache stays and the INT2 pool is sized apart: give num_pages= or "
                                 "memory_budget=")
            super().__init__(*args, **kwargs)
        else:
            if store.pool is not None and not store.pool_in_cache:
                raise ValueError("the INT2 pool lives in Transformers' cache memory for this model: size it with "
                                 "ContinuousBatchingConfig(num_blocks= / max_memory_percent=), not num_pages= / "
                                 "memory_budget=")
            with _oscar_allocation(store):
                super().__init__(*args, **kwargs)
            allocator = self.cache_allocators[FullAttentionCacheAllocator.layer_type]
            # The pool: one page per block, laid out in the cache tensor after its two trash sectors.
            trash = 2 * self.bytes_per_sector
            store.attach_pool(allocator.num_blocks, allocator.tokens_per_page, storage=self.cache_tensor[trash:])
            store.pool_in_cache = True
            # Transformers reads no past for these layers: the index tensors and sdpa masks it allocates are
            # [*, 1 + M] instead of [*, num_blocks * P + M], and the scheduler's read budget (max_tokens_read, minus
            # min(request length, read_cache_limit) per request) never runs out.
            self.max_tokens_read, self.read_cache_limit = 1, 0
        # The store's requests start empty: a prefix matched in the BF16 pages was never written to it.
        self.allow_block_sharing = self.use_prefix_sharing = False
        self.store = store
        self._pending: list[tuple[str, int, int]] = []
        self._batch: list[tuple[str, int, int]] = []

    # ------------------------------------------------------------------ batch composition
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        self._pending.append((request_id, int(past_length), int(query_length)))
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)

    def fill_block_table(self, request_id, past_length, query_length, block_table) -> None:
        self._pending.append((request_id, int(past_length), int(query_length)))
        super().fill_block_table(request_id, past_length, query_length, block_table)

    def update(self, key_states, value_states, layer_idx, kwargs):
        if self._pending:  # the first update of a forward: the requests recorded since the previous one
            self._batch, self._pending = self._pending, []
        if not self.store.handles(layer_idx):
            return super().update(key_states, value_states, layer_idx, kwargs)
        if kwargs.get("block_table") is not None:
            raise NotImplementedError("the OSCAR paged cache does not serve the flash block-table decode path")
        handle = PagedOscarKV(self.store, layer_idx, key_states, value_states, self._batch)
        return handle, handle

    # ------------------------------------------------------------------ requests leaving
    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache=no_cache)
        self.store.free(request_id)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        self.store.free_all()

    def prepare_fork_request(self, *args, **kwargs):
        raise NotImplementedError("the OSCAR paged cache does not fork requests (num_return_sequences > 1)")


def _check_cb_config(cbc) -> None:
    if cbc is None:
        return
    if cbc.cpu_offload_space:
        raise NotImplementedError("CPU offloading copies BF16 pages only; use cpu_offload_space=0 with OSCAR")
    if any(cbc.cuda_graph_booleans) or cbc.varlen_compile_config is not None or cbc.decode_compile_config is not None:
        raise NotImplementedError("the OSCAR paged reference does not run under CUDA graphs or torch.compile")


@contextlib.contextmanager
def paged_oscar(model, store: OscarPagedStore | None = None, **store_kwargs):
    """Serve ``model``'s continuous batching through OSCAR inside the block::

        with paged_oscar(model, method="hadamard") as store:
            outputs = model.generate_batch(inputs, generation_config)

    ``store`` an :class:`OscarPagedStore`, or its arguments (``store_kwargs``; device and dtype default to the
    model's). When the store quantizes every layer, its page pool lives in Transformers' cache tensor, sized by the
    ``ContinuousBatchingConfig`` (``num_blocks`` INT2 blocks, or ``max_memory_percent`` of free memory at OSCAR's
    bytes per token) with its ``page_size``: give no ``num_pages`` / ``memory_budget`` / ``page_size`` then. The model
    must be loaded with ``attn_implementation="sdpa"`` (or ``"eager"``)."""
    if store is None:
        store_kwargs.setdefault("device", model.device)
        store_kwargs.setdefault("dtype", model.dtype)
        if not any(k in store_kwargs for k in ("num_pages", "memory_budget")):
            store_kwargs["defer_pool"] = True
        store = OscarPagedStore(model, **store_kwargs)
    original = continuous_api.PagedAttentionCache
    if original is not PagedAttentionCache:
        raise RuntimeError("continuous_api.PagedAttentionCache is already replaced (nested paged_oscar?)")

    def build(*args, continuous_batching_config=None, **kwargs):
        _check_cb_config(continuous_batching_config)
        cache = OscarPagedCache(*args, continuous_batching_config=continuous_batching_config, store=store, **kwargs)
        enable_oscar(model)  # after the manager accepted "sdpa": from now on "oscar_sdpa"
        return cache

    continuous_api.PagedAttentionCache = build
    try:
        yield store
    finally:
        continuous_api.PagedAttentionCache = original
        disable_oscar(model)
        store.free_all()
        if store.pool_in_cache:  # the cache tensor it lived in belongs to the manager that is gone
            store.pool, store.pool_in_cache = None, False


def generate_batch(model, inputs, generation_config=None, continuous_batching_config=None, *, store=None,
                   **store_kwargs):
    """``model.generate_batch`` through OSCAR: :func:`paged_oscar` around one call (a fresh manager, no warmup)."""
    with paged_oscar(model, store, **store_kwargs):
        return model.generate_batch(inputs, generation_config, continuous_batching_config=continuous_batching_config,
                                    warmup=False)
