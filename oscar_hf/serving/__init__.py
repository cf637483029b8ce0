"""Serving many requests: a paged OSCAR KV store for Transformers' continuous batching (``model.generate_batch``,
``ContinuousBatchingManager``, ``transformers serve --continuous-batching`` through ``scripts/serve.py``), entered
with :func:`paged_oscar` or :func:`oscar_serving`. Usage, design, measurements, what is missing: docs/serving.md.
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
from .scheduler import register as _register_scheduler
from .store import OscarPagedStore

_register_scheduler()  # ContinuousBatchingConfig(scheduler_type="oscar_prefill_apart")

__all__ = ["PagedInt2Pool", "PoolExhausted", "page_bytes", "OscarPagedStore", "OscarPagedCache", "PagedOscarKV",
           "paged_oscar", "oscar_serving", "oscar_continuous_batching", "generate_batch", "continuous_batching_config",
           "SECTOR_API"]
