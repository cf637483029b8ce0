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

Not followed (refused loudly): prefix sharing (block sharing is turned off), forks (``num_return_sequences > 1``),
CPU offloading, CUDA graphs / compile (the read loops over requests in Python). See docs/serving.md.
"""
from __future__ import annotations

import contextlib
import inspect

import torch
from transformers.generation.continuous_batching import continuous_api
from transformers.generation.continuous_batching.cache import PagedAttentionCache

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


class OscarPagedCache(PagedAttentionCache):
    """``PagedAttentionCache`` whose OSCAR layers live in an :class:`OscarPagedStore` (see the module docstring).
    Built by :func:`paged_oscar` in place of the manager's own cache, with the manager's arguments."""

    def __init__(self, *args, store: OscarPagedStore, **kwargs):
        if "kwargs" not in inspect.signature(PagedAttentionCache.update).parameters:
            raise NotImplementedError("this Transformers version runs the paged cache from its `paged|*` attention "
                                      "function (5.17 style); the OSCAR paged cache needs cache.update(..., kwargs)")
        super().__init__(*args, **kwargs)
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

        with paged_oscar(model, method="hadamard", num_pages=4096, page_size=256) as store:
            outputs = model.generate_batch(inputs, generation_config)

    ``store`` an :class:`OscarPagedStore`, or its arguments (``store_kwargs``; device and dtype default to the
    model's). The model must be loaded with ``attn_implementation="sdpa"`` (or ``"eager"``)."""
    if store is None:
        store_kwargs.setdefault("device", model.device)
        store_kwargs.setdefault("dtype", model.dtype)
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


def generate_batch(model, inputs, generation_config=None, continuous_batching_config=None, *, store=None,
                   **store_kwargs):
    """``model.generate_batch`` through OSCAR: :func:`paged_oscar` around one call (a fresh manager, no warmup)."""
    with paged_oscar(model, store, **store_kwargs):
        return model.generate_batch(inputs, generation_config, continuous_batching_config=continuous_batching_config,
                                    warmup=False)
