"""Serving many requests: a paged OSCAR KV store for Transformers' continuous batching (``model.generate_batch``,
``ContinuousBatchingManager``, ``transformers serve --continuous-batching`` through ``scripts/serve.py``).

Data flow: :class:`PagedInt2Pool` (history pages) and the window pool -> :class:`OscarPagedStore` (per request a
window slot and a block table) -> :class:`OscarPagedCache` (Transformers' paged cache subclass) -> OSCAR's attention.

    from oscar_hf.serving import paged_oscar
    with paged_oscar(model, method="hadamard"):   # pages: ContinuousBatchingConfig(num_blocks / max_memory_percent)
        outputs = model.generate_batch(prompts, generation_config)

docs/serving.md has the design, what Transformers exposes, the measured load test and what is missing.
"""
# ruff: noqa: E402
import transformers as _transformers

from ..version import check_serving_transformers

check_serving_transformers(_transformers.__version__)  # before any continuous-batching internal is imported

from .batching import (SECTOR_API, OscarPagedCache, continuous_batching_config, generate_batch,
                       oscar_continuous_batching, paged_oscar)
from .engine import oscar_serving
from .paged_attention import PagedOscarKV
from .pool import PagedInt2Pool, PoolExhausted, page_bytes
from .store import OscarPagedStore

__all__ = ["PagedInt2Pool", "PoolExhausted", "page_bytes", "OscarPagedStore", "OscarPagedCache", "PagedOscarKV",
           "paged_oscar", "oscar_serving", "oscar_continuous_batching", "generate_batch", "continuous_batching_config",
           "SECTOR_API"]
