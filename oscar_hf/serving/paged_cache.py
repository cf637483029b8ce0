"""OSCAR's paged cache for Transformers 5.20+ continuous batching (:mod:`.paged_cache_blocks` serves 5.17 - 5.19):
``update`` returns a :class:`PagedOscarKV` handle for the store's layers; where the store holds every layer, its
allocator and memory handler size Transformers' cache tensor in INT2 pages. docs/serving.md sections 1 - 3."""
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
)
from transformers.generation.continuous_batching.cache_allocators import FullAttentionCacheAllocator
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from .paged_attention import PagedOscarKV, RecordedBatch
from .store import OscarPagedStore


class OscarCacheAllocator(FullAttentionCacheAllocator):
    """Transformers' block accounting for the store's layers, without BF16 K/V: a block is one store page of every
    quantized layer (a request of ``T`` tokens holds ``ceil((T - S0 - W) / P)``), bookkeeping only (the store keeps
    its own free list in the same memory): no read / write indices, and a request's keys are its new rows only."""

    supports_block_sharing = False  # Transformers keys blocks by their tokens; the store keys its pages (prefix.py)
    supports_block_table = False  # no flash decode fast path
    store: OscarPagedStore  # set on the subclass _oscar_allocation binds (Transformers sizes blocks on the class)

    @classmethod
    def get_bytes_per_page(cls, num_key_value_heads: int, head_dim: int, cache_dtype: torch.dtype,
                           page_size: int) -> int:
        if (num_key_value_heads, head_dim) != (cls.store.num_kv_heads, cls.store.head_dim):
            raise NotImplementedError(f"the OSCAR paged cache holds {cls.store.num_kv_heads} KV heads of "
                                      f"{cls.store.head_dim}; Transformers asks for {num_key_value_heads} of "
                                      f"{head_dim} (under tensor parallelism, build the store from the model: "
                                      "paged_oscar(model) or OscarPagedStore(model, ...), whose weights say which "
                                      "heads this rank holds)")
        # a block is one page of every layer: its bytes spread over the layers (rounded up: with retrieval heads the
        # layers' pages differ, and Transformers counts num_layers equal pages)
        return -(-cls.store.page_bytes(page_size) // cls.store.num_layers)

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool) -> None:
        self.bytes_per_sector = bytes_per_sector
        self._after_cache_tensor_init(non_trash_bytes, bytes_per_sector, cache_tensor, pool)  # no BF16 views

    def _compute_blocks_needed(self, allocated_blocks: int, past_length: int, query_length: int) -> int:
        return max(0, self.store.history_pages(past_length + query_length, self.tokens_per_page) - allocated_blocks)

    def get_seqlen_k(self, past_length: int, query_length: int) -> int:
        return query_length

    def get_read_indices(self, request_id: str, past_length: int, query_length: int) -> list[int]:
        return []

    get_write_indices = get_read_indices

    def count_shareable_blocks(self, source_request_id: str, past_length: int) -> int:
        """A fork shares the pages no later step writes (the store's count, not whole blocks of tokens)."""
        return min(self.store.shareable_pages(past_length), len(self.block_table[source_request_id]))

    def copy_blocks(self, source_block_ids, dest_block_ids) -> None:
        pass  # bookkeeping only: the store copied the pages (OscarPagedCache.prepare_fork_request)


class OscarMemoryHandler(PagedAttentionMemoryHandler):
    """Transformers' sizing when every layer is OSCAR's: a cache token costs its INT2 share of a sector only, the sdpa
    masks are ``[M, M]``, and :meth:`OscarPagedStore.reserved_bytes` (window slots, ``prompt_budget``) is reserved up
    front, so ``max_memory_percent`` bounds them all."""

    store: OscarPagedStore  # set on the subclass _oscar_allocation binds

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
        return self.io_multiplier * self.num_attention_masks * self.activation_dtype.itemsize * max_batch_tokens**2


_building = threading.local()  # .swaps {Transformers class: OSCAR's} while this thread builds an OSCAR cache
_installed = {"count": 0, "saved": None}
_install_lock = threading.Lock()
# where Transformers' cache construction finds the classes _oscar_allocation swaps: (namespace, name)
_SWAPPED = ((ATTN_TYPE_TO_ALLOCATOR, FullAttentionCacheAllocator.layer_type),
            (vars(cache_module), "FullAttentionCacheAllocator"),  # the handler's bytes per block
            (vars(cache_module), "PagedAttentionMemoryHandler"))


class _PerThread:
    """Stands in for a class of Transformers' ``continuous_batching.cache`` module: OSCAR's class in a thread building
    an OSCAR cache, Transformers' own in every other. Calls and attribute reads are forwarded."""

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
    """Inside: Transformers' cache construction in this thread uses the OSCAR allocator and memory handler (through
    :class:`_PerThread` stand-ins, restored on exit of the last builder)."""
    with _install_lock:
        if _installed["count"] == 0:
            _installed["saved"] = [names[name] for names, name in _SWAPPED]
            for (names, name), original in zip(_SWAPPED, _installed["saved"]):
                names[name] = _PerThread(original)
        _installed["count"] += 1
        allocator_cls, _, handler_cls = _installed["saved"]
    # subclasses bound to the store: Transformers builds them, and sizes blocks from the class, with its own arguments
    allocator, handler = (type("Bound" + c.__name__, (c,), {"store": store}) for c in (OscarCacheAllocator,
                                                                                        OscarMemoryHandler))
    _building.swaps = {allocator_cls: allocator, FullAttentionCacheAllocator: allocator, handler_cls: handler}
    try:
        yield
    finally:
        _building.swaps = {}
        with _install_lock:
            _installed["count"] -= 1
            if _installed["count"] == 0:
                for (names, name), original in zip(_SWAPPED, _installed["saved"]):
                    names[name] = original
                _installed["saved"] = None


class OscarPagedCache(RecordedBatch, PagedAttentionCache):
    """``PagedAttentionCache`` whose OSCAR layers live in an :class:`OscarPagedStore`; built by :func:`paged_oscar` in
    place of the manager's own cache, with the manager's arguments."""

    # 5.20 - 5.23: Transformers' sdpa function (not the layer) calls ``cache.update``; OSCAR's registered function
    # then does it first (oscar_hf.patching), so that the handle never reaches Transformers' function
    updates_in_attention = "cache" in inspect.signature(sdpa_attention_forward).parameters

    def __init__(self, config, continuous_batching_config, *args, store: OscarPagedStore, **kwargs):
        self._start_graphs(store, config, continuous_batching_config)
        # not owning the memory: a BF16 cache for the other layers, the store's pool sized by the user
        with _oscar_allocation(store) if self.oscar_owns_memory else contextlib.nullcontext():
            super().__init__(config, continuous_batching_config, *args, **kwargs)
        if self.oscar_owns_memory:
            allocator = self.cache_allocators[FullAttentionCacheAllocator.layer_type]
            # one page per block after the two trash sectors; the pool's trash page in the end of those sectors
            trash = 2 * self.bytes_per_sector - -(-store.page_bytes(allocator.tokens_per_page) // 128) * 128
            store.attach_pool(allocator.num_blocks, allocator.tokens_per_page, storage=self.cache_tensor[trash:])
            # Transformers reads no past for these layers: [*, 1 + M] index tensors and masks; no read budget spent
            self.max_tokens_read, self.read_cache_limit = 1, 0
        self._start_recording(store)

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
        """Transformers' admission, plus a window slot for a new request and a split prompt's ``prompt_budget``."""
        hold = self._prompt_hold(state, request_len)
        if not self.store.can_reserve(state.request_id, hold):
            return False
        ok = super().can_store_request_tokens(state, request_len, dry_run=dry_run)
        if ok and not dry_run:
            self.store.reserve(state.request_id, hold)
        return ok

    # ------------------------------------------------------------------ prefix sharing, forks (oscar_hf.serving.prefix)
    def get_num_free_blocks(self) -> int:
        """Blocks a request can take now (Transformers 5.17's name, which the 5.17 cache answers itself)."""
        allocator = self.cache_allocators[FullAttentionCacheAllocator.layer_type]
        return self.pool.count_free_blocks(allocator.index) + self.pool.num_free_sectors * allocator.blocks_per_sector

    def _share_blocks(self, request_id: str, holder: str | None, k: int) -> None:
        """The allocator holds the holder's blocks for the pages the request took from it, and fresh blocks for the
        retained pages it took (at most ``share_room``: it has them free), as for a request of ``k`` pages."""
        allocator, p = self.cache_allocators[FullAttentionCacheAllocator.layer_type], self.store.pool.page_size
        live = self.store.pages_from(request_id, holder)
        allocator.acquire_prefix_blocks(request_id, live * p, allocator.block_table[holder] if live else [])
        length = self.store.config.sink + self.store.config.recent + k * p  # history_pages(length) == k
        for _ in range(allocator.needs_new_sectors(request_id, length, 0)):
            self.pool.allocate_sector(allocator.index)
        allocator.allocate_cache_to_request(request_id, length, 0)

    def count_new_complete_blocks(self, state, request_len: int) -> dict[str, int]:
        """Non-empty (so ``mark_complete_blocks`` indexes the pages) once every ``P`` tokens, when a page is final."""
        n, shareable = state.current_len(), self.store.shareable_pages
        return {"oscar": 1} if self.use_prefix_sharing and shareable(n + request_len) > shareable(n) else {}

    def mark_complete_blocks(self, state, complete_blocks) -> None:
        if complete_blocks:
            self.store.index_pages(state.request_id, state.initial_tokens + state.generated_tokens)

    def prepare_fork_request(self, src_state, dst_req_ids: list[str], copy_src_and_dst) -> list[str]:
        """``num_return_sequences > 1``: the children that fit start as copies of the source; the rest are prefilled."""
        if not self.oscar_owns_memory:
            raise NotImplementedError("the OSCAR paged cache forks requests only where it holds every layer")
        fits = self.store.fork_fits(src_state.request_id, len(dst_req_ids))
        forked = super().prepare_fork_request(src_state, dst_req_ids[:fits], copy_src_and_dst)
        for child in forked:
            self.store.fork(src_state.request_id, child)
        return forked
