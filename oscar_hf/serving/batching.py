"""Selecting OSCAR in Transformers' continuous batching: :func:`paged_oscar` (a ``with`` block around
``model.generate_batch``, ``model.init_continuous_batching`` or a server) and :func:`generate_batch`.

The manager builds its cache inside ``_create_batch_processor`` from the module global
``continuous_api.PagedAttentionCache`` and accepts only ``sdpa`` / ``paged|*`` / flash attention names at
construction: :func:`paged_oscar` swaps that global for the duration of the block (on 5.17 - 5.19 also the function
that caps ``max_requests_per_batch`` by the cache's blocks, see :func:`paged_oscar`) and, once
the manager has accepted ``sdpa``, switches the model to OSCAR's attention: ``oscar_sdpa`` on Transformers 5.20+
(the model calls ``cache.update``, which hands OSCAR's handle to the registered function,
:mod:`~oscar_hf.serving.paged_cache`), ``paged|oscar_sdpa`` on 5.17 - 5.19 (the attention function receives the
cache, :mod:`~oscar_hf.serving.paged_cache_blocks`). Everything is restored on exit.
"""
from __future__ import annotations

import contextlib
import importlib.util

from transformers import AttentionInterface
from transformers.generation.continuous_batching import continuous_api

from ..attention import disable_oscar, enable_oscar
from .store import OscarPagedStore

# Transformers 5.20+ allocates its paged cache in sectors (continuous_batching/cache_allocators) and its models call
# cache.update(..., kwargs); before, block managers (cache_manager) and the `paged|*` functions call the cache.
SECTOR_API = importlib.util.find_spec("transformers.generation.continuous_batching.cache_allocators") is not None

if SECTOR_API:
    from .paged_cache import OscarPagedCache
else:
    from .paged_cache_blocks import ATTENTION_NAME, paged_oscar_attention
    from .paged_cache_blocks import OscarPagedCacheBlocks as OscarPagedCache

    AttentionInterface.register(ATTENTION_NAME, paged_oscar_attention)


def continuous_batching_config(page_size: int = 256, **kwargs):
    """``ContinuousBatchingConfig`` with pages of ``page_size`` tokens under either name (``page_size`` on
    Transformers 5.20+, ``block_size`` before)."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(**{"page_size" if SECTOR_API else "block_size": page_size}, **kwargs)


def _switch(model) -> list:
    """Route the model's attention through OSCAR; returns what :func:`_restore` needs."""
    if SECTOR_API:
        enable_oscar(model)
        return []
    configs = [c for c in {id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None),
                                                                                     "_attn_implementation")}.values()]
    saved = [(c, c._attn_implementation) for c in configs]
    for c in configs:  # set directly: the name is registered, and set_attn_implementation would re-validate it
        c._attn_implementation_internal = ATTENTION_NAME
    return saved


def _restore(model, saved: list) -> None:
    if SECTOR_API:
        disable_oscar(model)
        return
    for c, name in saved:
        if c._attn_implementation == ATTENTION_NAME:
            c._attn_implementation_internal = name


def _check_cb_config(cbc) -> None:
    if cbc is None:
        return
    if getattr(cbc, "use_async_batching", None):
        raise NotImplementedError("asynchronous batching prepares the next batch during a forward; use "
                                  "use_async_batching=False with OSCAR")
    if hasattr(cbc, "use_async_batching"):
        cbc.use_async_batching = False
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
    if getattr(original, "__name__", "") != "PagedAttentionCache" or original is OscarPagedCache:
        raise RuntimeError("continuous_api.PagedAttentionCache is already replaced (nested paged_oscar?)")

    saved = []

    def build(*args, continuous_batching_config=None, **kwargs):
        _check_cb_config(continuous_batching_config)
        cache = OscarPagedCache(*args, continuous_batching_config=continuous_batching_config, store=store, **kwargs)
        saved.extend(_switch(model))  # after the manager accepted "sdpa" (or "paged|sdpa")
        return cache

    continuous_api.PagedAttentionCache = build
    update = getattr(continuous_api, "update_cb_config_after_cache_creation", None)
    if not SECTOR_API and update is not None:
        # 5.17 - 5.19 cap max_requests_per_batch at the cache's num_blocks, which OSCAR's cache keeps at 1 (the
        # size of Transformers' unused K/V and of its masks): the cap follows the INT2 pages instead
        def update_with_pages(cb_config, num_blocks, *args, **kwargs):
            pages = store.pool.num_pages if store.pool is not None else num_blocks
            return update(cb_config, max(num_blocks, pages), *args, **kwargs)

        continuous_api.update_cb_config_after_cache_creation = update_with_pages
    try:
        yield store
    finally:
        continuous_api.PagedAttentionCache = original
        if update is not None:
            continuous_api.update_cb_config_after_cache_creation = update
        _restore(model, saved)
        store.free_all()
        if store.pool_in_cache:  # the cache tensor it lived in belongs to the manager that is gone
            store.pool, store.pool_in_cache = None, False


def generate_batch(model, inputs, generation_config=None, continuous_batching_config=None, *, store=None,
                   **store_kwargs):
    """``model.generate_batch`` through OSCAR: :func:`paged_oscar` around one call (a fresh manager, no warmup)."""
    with paged_oscar(model, store, **store_kwargs):
        return model.generate_batch(inputs, generation_config, continuous_batching_config=continuous_batching_config,
                                    warmup=False)
