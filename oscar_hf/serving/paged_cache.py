"""OSCAR's paged cache for Transformers 5.20+ continuous batching, whose sector allocators and
``cache.update(..., kwargs)`` it follows (:mod:`~oscar_hf.serving.paged_cache_blocks` serves 5.17 - 5.19;
:func:`~oscar_hf.serving.paged_oscar` picks the one that fits).

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
* :func:`~oscar_hf.serving.paged_oscar` builds it in place of the manager's own cache (see
  :mod:`~oscar_hf.serving.batching`).

Memory: when the store quantizes every layer of the model (all full attention, none skipped), Transformers allocates
no BF16 K/V at all. While :class:`OscarPagedCache` is constructed, the ``"full_attention"`` allocator is
:class:`OscarCacheAllocator` (a block = one INT2 page per layer; a request holds the pages of its history) and the
memory handler is :class:`OscarMemoryHandler` (no
BF16 read-back or ``[M, N + M]`` mask per cache token), so the flat cache tensor Transformers sizes from
``num_blocks`` / ``max_memory_percent`` holds INT2 pages, and the store's page pool is laid out in that tensor. The
scheduler's admission (``can_store_request_tokens``) then counts OSCAR bytes, a request also needs a free slot
of the store's window pool (at most ``max_requests`` full-precision windows, allocated on demand) and a prompt the
scheduler splits needs its length in the store's ``prompt_budget`` (its chunks are held in full precision until it
completes); the memory handler reserves both from ``max_memory_percent`` before sizing the pages. Models with layers
the store leaves to Transformers (sliding windows, ``skip_layers``) keep Transformers' BF16 cache and a separately
sized pool.

CUDA graphs (``use_cuda_graph``): decode-only batches replay Transformers' graphs with the store's decode step in
them; the host side of a step (:meth:`RecordedBatch.prepare_forward`) runs before the forward, see
:mod:`~oscar_hf.serving.batching`. Prefix sharing (``OscarPagedStore(prefix_sharing=True)``) and forks
(``num_return_sequences > 1``) are the store's (:mod:`~oscar_hf.serving.prefix`), where it holds every layer; not
followed (refused loudly): CPU offloading, torch.compile. See docs/serving.md.
"""
from __future__ import annotations

import contextlib
import inspect
import threading

import torch
from transformers.generation.continuous_batching import cache as cache_module
from transformers.generation.continuous_batching.cache import (
    ATTN_TYPE_TO_ALLOCATOR,
    PagedAttentionCache,
    PagedAttentionMemoryHandler,
    group_layers_by_attn_type,
)
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .paged_attention import PagedOscarKV, RecordedBatch
from .store import OscarPagedStore


class OscarCacheAllocator(FullAttentionCacheAllocator):
    """Transformers' block accounting for the layers the store quantizes, without their BF16 K/V.

    A block is one store page (``page_size`` history entries, keys and values, of every quantized layer: INT2 rows
    and the retrieval heads' coded rows): ``bytes_per_page`` is its bytes over the layers (rounded up), so sectors,
    ``num_blocks`` and the memory budget count OSCAR bytes. A request of ``T`` tokens holds
    ``ceil((T - S0 - W) / P)`` blocks: its history pages (the store's own count); its full-precision window is a slot
    of the store's window pool, allocated before Transformers sizes its cache (so ``max_memory_percent`` sees it) and
    taken at admission (:meth:`OscarPagedCache.can_store_request_tokens`). The blocks are bookkeeping only: the store
    writes its pages through its own free list in the same memory (``num_blocks`` pages), and holds at most as many
    pages as Transformers has handed out. Nothing here is read by the attention, so no read / write indices are
    produced and the keys each request attends to count as its new rows only (the ``[sum L, sum L]`` mask
    Transformers builds for sdpa is not read either). Bound to a store by :meth:`bind`."""

    supports_block_sharing = False  # Transformers keys blocks by their tokens; the store keys its pages (prefix.py)
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
                                      "(under tensor parallelism, build the store from the model: paged_oscar(model) "
                                      "or OscarPagedStore(model, ...), whose weights say which heads this rank holds)")
        # a block is one page of every layer: its bytes spread over the layers (rounded up: with retrieval heads the
        # layers' pages differ, and Transformers counts num_layers equal pages)
        return -(-cls.store.page_bytes(page_size) // cls.store.num_layers)

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self.bytes_per_sector = bytes_per_sector
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)  # no BF16 views

    def _compute_blocks_needed(self, allocated_blocks: int, past_length: int, query_length: int) -> int:
        p = self.tokens_per_page
        total = self.store.history_pages(past_length + query_length, p)
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

    def count_shareable_blocks(self, source_request_id: str, past_length: int) -> int:
        """A fork shares the pages no later step writes (the store's count, not whole blocks of tokens)."""
        return min(self.store.shareable_pages(past_length), len(self.block_table[source_request_id]))

    def copy_blocks(self, source_block_ids, dest_block_ids) -> None:
        pass  # bookkeeping only: the store copied the pages (OscarPagedCache.prepare_fork_request)


class OscarMemoryHandler(PagedAttentionMemoryHandler):
    """Transformers' sizing of the cache when every layer is OSCAR's: a cache token costs its INT2 share of a sector
    only (no BF16 read-back at the attention peak, no read index), the sdpa masks are ``[M, M]`` (each request's
    keys are its new rows for Transformers; the store reads the past), and what the store takes beside its pages is
    reserved up front (:meth:`OscarPagedStore.reserved_bytes`: ``max_requests`` window slots, allocated on demand, and
    the prompt chunks held in full precision, at most ``prompt_budget`` tokens), so that ``max_memory_percent`` bounds
    them all. Bound to a store by :meth:`bind`."""

    store: OscarPagedStore  # set on the bound subclass

    @classmethod
    def bind(cls, store: OscarPagedStore) -> type:
        return type("BoundOscarMemoryHandler", (cls,), {"store": store})

    @property
    def fixed_overhead_bytes(self) -> int:
        return super().fixed_overhead_bytes + self.store.reserved_bytes(self._max_batch_tokens())

    def _max_batch_tokens(self) -> int:
        return self.cb_config.max_batch_tokens or self._default_max_batch_tokens

    def infer_max_batch_tokens_and_num_sectors(self) -> tuple[int, int]:
        if self.cb_config.num_blocks is None:  # sized from memory: say what the memory does not pay for
            m = self._max_batch_tokens()
            need = self.fixed_overhead_bytes + m * self.bytes_per_batch_token + self.bytes_per_cache_sector
            if self.available_memory < need:
                raise ValueError(
                    f"the memory for the cache ({self.available_memory} bytes: max_memory_percent of what is free) "
                    f"does not pay for one sector of pages ({self.bytes_per_cache_sector} bytes) after the "
                    f"{m}-token batch ({m * self.bytes_per_batch_token} bytes) and the OSCAR store's reservation "
                    f"({self.store.reserved_bytes(m)} bytes: {self.store.windows.num_slots} window slots, "
                    f"prompt_budget={self.store.prompt_budget} tokens): lower max_requests or prompt_budget, or raise "
                    "max_memory_percent")
        return super().infer_max_batch_tokens_and_num_sectors()

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


_building = threading.local()  # .swaps {Transformers class: OSCAR's} while this thread builds an OSCAR cache
_installed = {"count": 0, "saved": None}
_install_lock = threading.Lock()


class _PerThread:
    """Stands in for a class of Transformers' ``continuous_batching.cache`` module while some thread builds an OSCAR
    cache: in that thread it is OSCAR's class, in every other thread Transformers' own (a plain paged cache built
    meanwhile in another thread gets Transformers' allocator and sizing). Calls and attribute reads are forwarded."""

    def __init__(self, original: type):
        self.original = original

    def _target(self) -> type:
        return getattr(_building, "swaps", {}).get(self.original, self.original)

    def __call__(self, *args, **kwargs):
        return self._target()(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._target(), name)


@contextlib.contextmanager
def _oscar_allocation(store: OscarPagedStore):
    """Inside: Transformers' cache construction *in this thread* uses the OSCAR allocator and memory handler (the
    module globals of ``continuous_batching.cache`` it reads are :class:`_PerThread` stand-ins while any thread builds
    an OSCAR cache; Transformers' own classes otherwise). Restored on exit of the last builder."""
    full = FullAttentionCacheAllocator.layer_type
    with _install_lock:
        if _installed["count"] == 0:
            saved = (ATTN_TYPE_TO_ALLOCATOR[full], cache_module.FullAttentionCacheAllocator,
                     cache_module.PagedAttentionMemoryHandler)
            _installed["saved"] = saved
            ATTN_TYPE_TO_ALLOCATOR[full] = _PerThread(saved[0])
            cache_module.FullAttentionCacheAllocator = _PerThread(saved[1])  # the handler's bytes per block
            cache_module.PagedAttentionMemoryHandler = _PerThread(saved[2])
        _installed["count"] += 1
        allocator_cls, handler_cls = _installed["saved"][0], _installed["saved"][2]
    allocator = OscarCacheAllocator.bind(store)
    _building.swaps = {allocator_cls: allocator, FullAttentionCacheAllocator: allocator,
                       handler_cls: OscarMemoryHandler.bind(store)}
    try:
        yield
    finally:
        _building.swaps = {}
        with _install_lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                saved = _installed["saved"]
                ATTN_TYPE_TO_ALLOCATOR[full], cache_module.FullAttentionCacheAllocator = saved[:2]
                cache_module.PagedAttentionMemoryHandler = saved[2]
                _installed["saved"] = None


class OscarPagedCache(RecordedBatch, PagedAttentionCache):
    """``PagedAttentionCache`` whose OSCAR layers live in an :class:`OscarPagedStore` (see the module docstring).
    Built by :func:`paged_oscar` in place of the manager's own cache, with the manager's arguments."""

    # 5.20 - 5.23: Transformers' sdpa function (not the layer) calls ``cache.update``; OSCAR's registered function
    # then does it first (oscar_hf.patching), so that the handle never reaches Transformers' function
    updates_in_attention = "cache" in inspect.signature(sdpa_attention_forward).parameters

    def __init__(self, *args, store: OscarPagedStore, **kwargs):
        config = args[0] if args else kwargs["config"]
        self._start_graphs(store, args[1] if len(args) > 1 else kwargs.get("continuous_batching_config"))
        self.oscar_owns_memory = store_owns_every_layer(store, config)
        store.check_pool_sizing(follows_blocks=self.oscar_owns_memory)
        if not self.oscar_owns_memory:  # BF16 cache for the other layers, the store's pool sized by the user
            super().__init__(*args, **kwargs)
        else:
            with _oscar_allocation(store):
                super().__init__(*args, **kwargs)
            allocator = self.cache_allocators[FullAttentionCacheAllocator.layer_type]
            # The pool: one page per block, laid out in the cache tensor after its two trash sectors, and the
            # pool's trash page (where rows that demote nothing write) in the end of those sectors: a sector holds
            # at least one page of every layer (Transformers never writes there: no BF16 layer).
            trash = 2 * self.bytes_per_sector - -(-store.page_bytes(allocator.tokens_per_page) // 128) * 128
            store.attach_pool(allocator.num_blocks, allocator.tokens_per_page, storage=self.cache_tensor[trash:])
            # Transformers reads no past for these layers: the index tensors and sdpa masks it allocates are
            # [*, 1 + M] instead of [*, num_blocks * P + M], and the scheduler's read budget (max_tokens_read, minus
            # min(request length, read_cache_limit) per request) never runs out.
            self.max_tokens_read, self.read_cache_limit = 1, 0
        # Prefix sharing is the store's (its own page keys: prefix.py), where it holds every layer and was asked for;
        # Transformers' own would match BF16 blocks the store never wrote.
        self.allow_block_sharing = self.use_prefix_sharing = (
            self.oscar_owns_memory and store.prefix_sharing and self.allow_block_sharing)
        self.store = store
        if self.cuda_graphs:  # every window slot now: a captured graph holds their addresses
            store.windows.fix()
        self._start_recording()

    # ------------------------------------------------------------------ batch composition
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        self._record(request_id, past_length, query_length)
        super().extend_read_and_write_indices(request_id, past_length, query_length, read_index, write_index)

    def fill_block_table(self, request_id, past_length, query_length, block_table) -> None:
        self._record(request_id, past_length, query_length)
        super().fill_block_table(request_id, past_length, query_length, block_table)

    def update(self, key_states, value_states, layer_idx, kwargs):
        batch = self.batch()  # taken by the forward's first layer, whoever serves it
        if not self.store.handles(layer_idx):
            return super().update(key_states, value_states, layer_idx, kwargs)
        if kwargs.get("block_table") is not None:
            raise NotImplementedError("the OSCAR paged cache does not serve the flash block-table decode path")
        handle = PagedOscarKV(self.store, layer_idx, key_states, value_states, batch)
        return handle, handle

    # ------------------------------------------------------------------ admission, requests leaving
    def can_store_request_tokens(self, state, request_len: int, dry_run: bool = False) -> bool:
        """Transformers' admission, a window slot of the store for a request that has none yet, and, for a prompt this
        step splits, its share of the store's ``prompt_budget`` (:meth:`OscarPagedStore.admit_prompt`)."""
        new = state.request_id not in self.store.requests
        if new and not self.store.can_reserve():
            return False
        hold = self._prompt_hold(state, request_len)
        if hold and not self.store.can_hold(hold):
            return False
        ok = super().can_store_request_tokens(state, request_len, dry_run=dry_run)
        if ok and not dry_run:
            self.store.reserve(state.request_id)
            if hold:
                self.store.admit_prompt(state.request_id, hold)
        return ok

    def free_blocks(self, request_id: str, no_cache: bool = False) -> None:
        super().free_blocks(request_id, no_cache=no_cache)
        self.store.free(request_id)

    def free_all_requests(self, clear_ledgers: bool = False) -> None:
        super().free_all_requests(clear_ledgers)
        self.store.free_all()

    # ------------------------------------------------------------------ prefix sharing, forks (oscar_hf.serving.prefix)
    def search_prefix_match(self, request_id: str, prompt_ids: list[int]) -> int:
        """Tokens of the prompt a new request takes from a live request's pages (the store's match); Transformers'
        allocator holds the same blocks for it, so that admission counts the shared pages once."""
        if not self.use_prefix_sharing:
            return 0
        m, holder, k = self.store.share_prefix(request_id, list(prompt_ids))
        if m:
            allocator = self.cache_allocators[FullAttentionCacheAllocator.layer_type]
            allocator.acquire_prefix_blocks(request_id, k * allocator.tokens_per_page, allocator.block_table[holder])
        return m

    def count_new_complete_blocks(self, state, request_len: int) -> dict[str, int]:
        """Non-empty (then ``mark_complete_blocks`` offers the request's pages) when this forward writes a page for
        good: once every ``P`` tokens, not every step (the offer reads the request's tokens)."""
        n, shareable = state.current_len(), self.store.shareable_pages
        return {"oscar": 1} if self.use_prefix_sharing and shareable(n + request_len) > shareable(n) else {}

    def mark_complete_blocks(self, state, complete_blocks) -> None:
        if complete_blocks:
            self.store.index_pages(state.request_id, state.initial_tokens + state.generated_tokens)

    def prepare_fork_request(self, src_state, dst_req_ids: list[str], copy_src_and_dst) -> list[str]:
        """``num_return_sequences > 1``: as many children as the store and Transformers' blocks hold start as copies
        of the source (:meth:`OscarPagedStore.fork`); Transformers prefills the others anew."""
        if not self.oscar_owns_memory:
            raise NotImplementedError("the OSCAR paged cache forks requests only where it holds every layer")
        fits = self.store.fork_fits(src_state.request_id, len(dst_req_ids))
        forked = super().prepare_fork_request(src_state, dst_req_ids[:fits], copy_src_and_dst)
        for child in forked:
            self.store.fork(src_state.request_id, child)
        return forked
