"""Serving many requests: a paged OSCAR KV store for Transformers' continuous batching (``model.generate_batch``).

Data flow: :class:`PagedInt2Pool` (INT2 history pages, one pool for every request) -> :class:`OscarPagedStore`
(per request: BF16 sink + recent window, block table; write path and read) -> :class:`OscarPagedCache` (the
``PagedAttentionCache`` subclass that hands each batch to the store) -> the registered ``oscar_sdpa`` attention.

    from oscar_hf.serving import paged_oscar
    with paged_oscar(model, method="hadamard"):   # pages: ContinuousBatchingConfig(num_blocks / max_memory_percent)
        outputs = model.generate_batch(prompts, generation_config)

When the store quantizes every layer, Transformers allocates no BF16 K/V: its cache tensor holds the INT2 pages and
its scheduler admits requests by OSCAR's bytes (:class:`OscarCacheAllocator`).

CPU reference (torch read and write path, one request at a time inside a batch); docs/serving.md has the design,
what Transformers exposes and what is still missing for the GPU (kernels through the block table, CUDA graphs).
"""
from .paged_cache import OscarCacheAllocator, OscarPagedCache, PagedOscarKV, generate_batch, paged_oscar
from .pool import PagedInt2Pool, PoolExhausted, page_bytes
from .store import OscarPagedStore

__all__ = ["PagedInt2Pool", "PoolExhausted", "page_bytes", "OscarPagedStore", "OscarPagedCache", "OscarCacheAllocator",
           "PagedOscarKV", "paged_oscar", "generate_batch"]
