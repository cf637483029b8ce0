"""OSCAR in continuous batching for Transformers 5.17 - 5.19, whose ``paged|*`` attention functions call the cache
and whose ``BlockManager`` counts memory: OSCAR registers ``paged|oscar_sdpa``; where the store has every layer a block
is one INT2 page of every layer and Transformers' own K/V is sized for a single block (docs/serving.md section 1)."""
from __future__ import annotations

import copy

import torch
from transformers.generation.continuous_batching.cache import (
    PagedAttentionCache,
    PagedAttentionMemoryHandler,
    group_layers_by_attn_type,
)
from transformers.generation.continuous_batching.cache_manager import BlockManager

from .paged_attention import PagedOscarKV, RecordedBatch
from .store import OscarPagedStore

ATTENTION_NAME = "paged|oscar_sdpa"


class OscarPagedCacheBlocks(RecordedBatch, PagedAttentionCache):
    """``PagedAttentionCache`` (block-manager API) whose OSCAR layers live in an :class:`OscarPagedStore`."""

    def __init__(self, config, continuous_batching_config, device, distributed_helper, tp_plan=None,
                 dtype=torch.float16, *, store: OscarPagedStore):
        self._start_graphs(store, config, continuous_batching_config)
        cbc = continuous_batching_config
        if self.oscar_owns_memory:
            pages = cbc.num_blocks
            if pages is None:  # the bytes Transformers would give BF16 blocks, spent on INT2 pages
                _, types = group_layers_by_attn_type(config)
                handler = PagedAttentionMemoryHandler(config, cbc, dtype, types, store.num_layers)
                mbt, bf16_blocks = handler.infer_max_batch_tokens_and_num_blocks()
                if cbc.max_batch_tokens is None:
                    cbc.max_batch_tokens = mbt
                bf16_bytes = (2 * store.num_layers * store.num_kv_heads * cbc.block_size * store.head_dim
                              * dtype.itemsize)
                # less what the store takes beside its pages (window slots, prompt chunks: reserved_bytes)
                pages = store.pages_in(bf16_blocks * bf16_bytes, cbc.block_size, cbc.max_batch_tokens)
            cbc = copy.copy(cbc)
            cbc.num_blocks = 1  # Transformers' own K/V: one block (the caller's config keeps its own)
        super().__init__(config, cbc, device, distributed_helper, tp_plan or {}, dtype)
        if self.oscar_owns_memory:
            self.num_blocks = 1  # what Transformers sizes its index tensors and masks from
            self.num_pages = pages * self.block_size  # the scheduler's read budget: never the limit
            self._block_manager = BlockManager(pages, self.block_size, tp_on=False)
            store.attach_pool(pages, self.block_size)
        self._start_recording(store)

    # ------------------------------------------------------------------ admission
    def attach_scheduler(self, scheduler) -> None:
        """Also count a split prompt in ``prompt_budget``: ``allocate_blocks`` is not told the step's tokens, so this
        scheduler instance's ``_allocate_blocks_if_needed`` is wrapped."""
        super().attach_scheduler(scheduler)
        allocate = scheduler._allocate_blocks_if_needed

        def allocate_with_prompt(state, len_next_tokens: int) -> bool:
            hold = self._prompt_hold(state, len_next_tokens)
            if hold and not self.store.can_reserve(state.request_id, hold):
                return False
            ok = allocate(state, len_next_tokens)
            if ok and hold:
                self.store.reserve(state.request_id, hold)
            return ok

        scheduler._allocate_blocks_if_needed = allocate_with_prompt

    def allocate_blocks(self, n_blocks: int, request_id: str, allocated_blocks: int) -> int | None:
        if not self.store.can_reserve(request_id):  # a window slot for a new request
            return None
        allocated = super().allocate_blocks(n_blocks, request_id, allocated_blocks)
        if allocated is not None:
            self.store.reserve(request_id)
        return allocated

    # ------------------------------------------------------------------ prefix sharing, forks (oscar_hf.serving.prefix)
    def _share_blocks(self, request_id: str, holder: str | None, k: int) -> None:
        """The request's block table starts with the holder's blocks for the pages it took from it (referenced once
        more), then fresh blocks for the retained pages it took (at most ``share_room``: free ones)."""
        cm, live = self.group_cache_managers[0], self.store.pages_from(request_id, holder)
        cm.block_table[request_id] = list(cm.block_table[holder][:live]) if live else []
        for block in cm.block_table[request_id]:
            self._block_manager.increase_ref_count(block)
        if k > live:
            super().allocate_blocks(k - live, request_id, live)

    def mark_shareable_blocks_as_complete(self, state, num_complete_blocks: int) -> None:
        """After a forward that completed blocks: offer the request's final pages for sharing (the store's count)."""
        if self.use_prefix_sharing and num_complete_blocks:
            self.store.index_pages(state.request_id, state.initial_tokens + state.generated_tokens)

    def compute_max_num_forks(self, source_request_id: str) -> int:
        if not self.oscar_owns_memory:
            raise NotImplementedError("the OSCAR paged cache forks requests only where it holds every layer")
        return min(super().compute_max_num_forks(source_request_id),
                   self.store.fork_fits(source_request_id, self.store.windows.num_slots))

    def fork_request(self, source_request_id: str, destination_request_ids: list[str]) -> tuple[list[int], list[int]]:
        """``num_return_sequences > 1``: the block manager's accounting, then the children as copies of the source in
        the store (nothing left for Transformers to copy)."""
        super().fork_request(source_request_id, destination_request_ids)
        for child in destination_request_ids:
            self.store.fork(source_request_id, child)
        return [], []

    # ------------------------------------------------------------------ batch composition
    def extend_read_and_write_indices(self, request_id, past_length, query_length, read_index, write_index) -> None:
        self._record(request_id, past_length, query_length)
        if not self.oscar_owns_memory:
            return super().extend_read_and_write_indices(request_id, past_length, query_length, read_index,
                                                         write_index)
        for indices in write_index:  # Transformers' K/V of OSCAR layers is never written: the trash slot
            indices.extend([self.write_trash_index] * query_length)

    def fill_block_table(self, *args, **kwargs) -> None:
        raise NotImplementedError("the OSCAR paged cache does not serve the flash block-table decode path")

    def get_seqlens_k(self, past_length: int, query_length: int) -> dict[str, int]:
        if self.oscar_owns_memory:  # Transformers reads no past for these layers: its mask is [M, M]
            return {"full_attention": query_length}
        return super().get_seqlens_k(past_length, query_length)


def paged_oscar_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """``paged|oscar_sdpa``: OSCAR's store for its layers, Transformers' ``paged|sdpa`` for the others."""
    cache = kwargs.get("cache")
    if isinstance(cache, OscarPagedCacheBlocks) and cache.store.handles(module.layer_idx):
        if scaling is None:
            scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        handle = PagedOscarKV(cache.store, module.layer_idx, key, value, cache.batch())
        return handle.attend(query, attention_mask, scaling, module, "sdpa", **kwargs), None
    from transformers.integrations.sdpa_paged import sdpa_attention_paged_forward

    return sdpa_attention_paged_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                        **kwargs)
