"""Selecting OSCAR in Transformers' continuous batching: :func:`paged_oscar` (a ``with`` block around
``model.generate_batch``, ``model.init_continuous_batching`` or a server) and :func:`generate_batch`. How the block
swaps ``continuous_api.PagedAttentionCache`` and the attention name: docs/serving.md section 2."""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import logging
import threading
import types
import weakref

import torch
from transformers import AttentionInterface
from transformers.generation.continuous_batching import continuous_api, input_outputs

from ..attention import PREFIX
from ..config import ModelFingerprint
from ..patching import attention_configs, split_name
from . import admission
from .store import OscarPagedStore

logger = logging.getLogger("oscar_hf")
# logged with the store's stats as JSON when a stopped manager's store gives its memory back (a load test reads it)
STORE_RELEASED = "OSCAR store released after its manager stopped; it held:"

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


def _attention_configs(target) -> list:
    """The configs whose ``_attn_implementation`` the attention modules read: a model's modules', or ``target``."""
    return attention_configs(target) if isinstance(target, torch.nn.Module) else [target]


def _switch(target) -> list:
    """Route the attention of ``target`` (a model or its config) through OSCAR; returns ``[(config, old, new)]``."""
    saved = []
    for c in _attention_configs(target):
        old = c._attn_implementation
        new = PREFIX + split_name(old)[1].removeprefix("paged|") if SECTOR_API else ATTENTION_NAME
        # set directly: both names are registered, and set_attn_implementation would re-validate them
        c._attn_implementation_internal = new
        saved.append((c, old, new))
    return saved


def _restore(saved: list) -> None:
    for c, old, new in saved:
        if c._attn_implementation == new:
            c._attn_implementation_internal = old


def _check_cb_config(cbc) -> None:
    if cbc is None:
        return
    if getattr(cbc, "use_async_batching", None):
        raise NotImplementedError("asynchronous batching prepares the next batch during a forward; use "
                                  "use_async_batching=False with OSCAR")
    if hasattr(cbc, "use_async_batching"):
        cbc.use_async_batching = False
    if SECTOR_API and OscarPagedCache.updates_in_attention and any(cbc.cuda_graph_booleans):  # (as _start_graphs)
        raise NotImplementedError("CUDA graphs with OSCAR need Transformers 5.24+ (5.20 - 5.23 build the packed "
                                  "batch's mask with a host sync inside the capture): use_cuda_graph=False")
    if cbc.cpu_offload_space:
        raise NotImplementedError("CPU offloading copies BF16 pages only; use cpu_offload_space=0 with OSCAR")
    if cbc.varlen_compile_config is not None or cbc.decode_compile_config is not None:
        raise NotImplementedError("OSCAR serving does not run under torch.compile (varlen_compile_config / "
                                  "decode_compile_config / default_compile_level); CUDA graphs (use_cuda_graph=True) "
                                  "serve its decode steps")


def _install_graph_hooks(processor) -> None:
    """Let Transformers' CUDA graphs replay OSCAR's decode steps on this batch processor (docs/serving.md, "CUDA
    graphs"): ``compute_batch`` first runs the cache's host side (:meth:`RecordedBatch.prepare_forward`)."""
    cache, runner, io = processor.cache, processor.model_runner, processor.inputs_and_outputs
    compute, forward_fn, graph_key = runner.compute_batch, runner._get_forward_fn, io._get_graph_key

    def compute_batch(model, batch_data):
        # what Transformers packed, in row order (its prepare_batch_tensors has advanced each position_offset)
        packed = [(f.state.request_id, f.state.position_offset - f.query_length, f.query_length)
                  for f in io.requests_in_batch]
        cache.prepare_forward(batch_data["input_ids"].shape[-1], packed)
        return compute(model, batch_data)

    def get_forward_fn(use_block_table: bool):
        fn, _ = forward_fn(use_block_table)
        return fn, cache.graph_step

    runner.compute_batch, runner._get_forward_fn = compute_batch, get_forward_fn

    def oscar_graph_key():
        # Transformers' varlen key is (padded rows, padded KV read, longest KV per layer group); where the store holds
        # every layer, the forward reads none of Transformers' K/V, so the KV sizes change nothing in a captured decode
        # step: keyed by them, each request that joined (a 16K shared prefix: +16K read) cost a new capture (~150-250
        # ms on an H100, in the way of the next joiner's first token). The store's key is (padded rows, history bound).
        if cache.graph_step and cache.oscar_owns_memory:
            return (*graph_key()[:1], *cache.graph_key)
        return (*graph_key(), *cache.graph_key)

    io._get_graph_key = oscar_graph_key


def _check_processor(processor) -> None:
    """Refuse a batch processor whose cache is not OSCAR's (Transformers' internals moved) instead of serving BF16."""
    if not isinstance(getattr(processor, "cache", None), OscarPagedCache):
        raise RuntimeError(
            "continuous batching built a cache that is not OSCAR's ("
            f"{type(getattr(processor, 'cache', None)).__name__}) inside an OSCAR block: this Transformers version "
            "builds its paged cache in a way oscar_hf does not follow, and would serve plain BF16")


def _manager_patches(serves, scheduler_type: str | None = None) -> list[tuple[object, str, object]]:
    """``[(owner, name, replacement)]`` on Transformers' manager: for the managers ``serves(config)`` accepts, no
    switch to flash attention (it would bypass the store), checked batch processors, admission and release hooks;
    ``scheduler_type``: their scheduler, whatever their config says (``transformers serve`` has no option for it)."""
    manager = getattr(continuous_api, "ContinuousBatchingManager", None)
    create = getattr(manager, "_create_batch_processor", None)
    if create is None:
        raise RuntimeError("transformers.generation.continuous_batching has no ContinuousBatchingManager."
                           "_create_batch_processor: this Transformers version is outside oscar_hf's serving range")

    def create_checked(self):
        if scheduler_type is not None and serves(self.model.config):  # (read by _create_batch_processor, 5.17-5.25)
            self.continuous_batching_config.scheduler_type = scheduler_type
        processor = create(self)
        if serves(self.model.config) and not getattr(processor, "oscar_hooked", False):  # (a reset one: once)
            _check_processor(processor)
            processor.cache.attach_scheduler(processor.scheduler)  # its request states: prompt lengths and ends
            _install_graph_hooks(processor)
            admission.install(self, processor)  # requests the store cannot serve fail alone
            processor.oscar_hooked = True
        return processor

    def checked(original, hook):  # the manager's own method, or admission's hook around it where OSCAR serves
        return lambda self, *a, **k: (hook(self, original, *a, **k) if serves(self.model.config)
                                      else original(self, *a, **k))

    stop = manager.stop

    def stop_and_release(self, *args, **kwargs):
        # the store's memory goes back with its manager (a model switch in `transformers serve` stops the old one)
        cache = getattr(getattr(self, "batch_processor", None), "cache", None)
        thread = getattr(self, "_generation_thread", None)
        out = stop(self, *args, **kwargs)
        if isinstance(cache, OscarPagedCache) and getattr(self, "batch_processor", None) is None:  # not kept
            def release():
                held = cache.store.stats()  # what the store held once its loop was over: no request, page or slot
                cache.store.release_memory()
                _restore(getattr(cache, "oscar_switched", []))  # the model's attention as the manager found it
                logger.info("%s %s", STORE_RELEASED, json.dumps(held))

            if thread is not None and thread.is_alive():  # stopped with a timeout while its loop still flushes:
                # release once the loop is over (its requests still need the store)
                threading.Thread(target=lambda: (thread.join(), release()), name="oscar-release-after-flush",
                                 daemon=True).start()
            else:
                release()
        return out

    patches = [(manager, "_create_batch_processor", create_checked), (manager, "stop", stop_and_release),
               (manager, "add_request", checked(manager.add_request, admission.add_request)),
               (manager, "register_result_handler",
                checked(manager.register_result_handler, admission.register_result_handler))]
    switch = getattr(manager, "switch_to_cb_friendly_attn", None)
    if switch is not None and "auto_switch_to_flash" in inspect.signature(switch).parameters:
        # (5.17 - 5.19 have no such flag: there the OSCAR attention name replaces whatever the switch chose)
        def keep_attention(self, model, auto_switch_to_flash: bool = True):
            return switch(self, model, auto_switch_to_flash and not serves(model.config))

        patches.append((manager, "switch_to_cb_friendly_attn", keep_attention))
    return patches


@contextlib.contextmanager
def oscar_continuous_batching(make_store, model=None, scheduler_type: str | None = None):
    """Inside the block, every continuous-batching manager of ``model`` (without one: every manager) builds OSCAR's
    paged cache with the store ``make_store(config, device, dtype)`` returns, and routes the attention through OSCAR
    (``scheduler_type``: its scheduler instead of its config's, e.g. ``"oscar_prefill_apart"``).
    A stopping manager gives its store's memory and attention name back; stores are held weakly (yielded as a live
    ``WeakSet``). Restored on exit."""
    original = continuous_api.PagedAttentionCache
    if getattr(original, "__name__", "") != "PagedAttentionCache" or original is OscarPagedCache:
        raise RuntimeError("continuous_api.PagedAttentionCache is already replaced (nested paged_oscar?)")
    signature = inspect.signature(original.__init__)
    saved, stores = [], weakref.WeakSet()
    built = threading.local()  # .pages: INT2 pages of the OSCAR cache this thread built last (5.17 - 5.19)
    # a model routed through OSCAR by an OscarCache run (oscar_sdpa) is shown to the manager as its base (sdpa)
    entry = [] if model is None else [(c, c._attn_implementation) for c in _attention_configs(model)
                                      if split_name(c._attn_implementation)[0] == PREFIX]
    for c, name in entry:
        c._attn_implementation_internal = split_name(name)[1]

    # with a model, only its managers get OSCAR; without one (a server loading its models), every manager does
    ours = None if model is None else {id(c) for c in _attention_configs(model)} | {id(model.config.get_text_config())}

    def serves(config) -> bool:
        return ours is None or id(config) in ours

    # Transformers builds the attention masks only for the attention names it knows (sdpa, eager), not OSCAR's: the
    # layers a cache leaves in BF16 (sliding windows, skipped layers) read them, OSCAR's own read does not need them
    bf16_layers: dict[int, bool] = {}  # id(config) of a cache OSCAR built -> whether it leaves layers in BF16
    mask_is_needed = input_outputs.attn_mask_is_needed

    def mask_needed(config) -> bool:
        if mask_is_needed(config):
            return True
        name = config._attn_implementation or ""
        base = types.SimpleNamespace(_attn_implementation=name.replace(PREFIX, "", 1))  # oscar_sdpa -> sdpa
        return bf16_layers.get(id(config), False) and name != base._attn_implementation and mask_is_needed(base)

    def build(*args, **kwargs):
        arguments = signature.bind(None, *args, **kwargs).arguments
        if not serves(arguments["config"]):
            return original(*args, **kwargs)
        _check_cb_config(arguments.get("continuous_batching_config"))
        dtype = arguments.get("dtype", signature.parameters["dtype"].default)
        store = make_store(arguments["config"], arguments["device"], dtype)
        if not getattr(store, "bf16_named", False):  # once per store: the layers left to Transformers' BF16 cache
            store.bf16_named = True
            types = ModelFingerprint.from_config(arguments["config"]).layer_types
            if left := {i: t for i, t in enumerate(types) if not store.handles(i)}:
                logger.warning("OSCAR serving keeps layers %s (%s) in BF16 in Transformers' paged cache: only the "
                               "other %d layers are quantized", sorted(left), ", ".join(sorted(set(left.values()))),
                               store.num_layers)
        cache = OscarPagedCache(*args, store=store, **kwargs)
        bf16_layers[id(arguments["config"])] = not cache.oscar_owns_memory
        stores.add(store)
        built.pages = store.pool.num_pages if cache.oscar_owns_memory else None
        # after the manager accepted sdpa; undone when the manager stops (the next manager of the model checks it)
        cache.oscar_switched = _switch(model if model is not None else arguments["config"])
        saved.extend(cache.oscar_switched)
        return cache

    patches = [(continuous_api, "PagedAttentionCache", build), (input_outputs, "attn_mask_is_needed", mask_needed),
               *_manager_patches(serves, scheduler_type)]
    update = getattr(continuous_api, "update_cb_config_after_cache_creation", None)
    if not SECTOR_API and update is not None:
        # 5.17 - 5.19 cap max_requests_per_batch at the cache's num_blocks, which OSCAR's cache keeps at 1: the cap
        # follows the INT2 pages of the cache this thread just built
        def update_with_pages(cb_config, num_blocks, *args, **kwargs):
            pages, built.pages = getattr(built, "pages", None), None
            return update(cb_config, num_blocks if pages is None else max(num_blocks, pages), *args, **kwargs)

        patches.append((continuous_api, "update_cb_config_after_cache_creation", update_with_pages))
    originals = [(owner, name, vars(owner).get(name)) for owner, name, _ in patches]  # None: inherited
    for owner, name, new in patches:
        setattr(owner, name, new)
    try:
        yield stores
    finally:
        for owner, name, old in originals:
            if old is None:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        _restore(saved)
        for c, name in entry:
            c._attn_implementation_internal = name
        for store in stores:  # the managers of the block are gone: their stores' memory with them
            store.release_memory()


@contextlib.contextmanager
def paged_oscar(model, store: OscarPagedStore | None = None, **store_kwargs):
    """Serve ``model``'s continuous batching through OSCAR inside the block (usage: docs/serving.md). ``store``: an
    :class:`OscarPagedStore`, or its arguments (device and dtype default to the model's). When it quantizes every
    layer, its pool is sized by the ``ContinuousBatchingConfig`` (give no ``num_pages`` / ``memory_budget`` /
    ``page_size`` then). The model must be loaded with ``attn_implementation="sdpa"``."""
    if store is None:
        store_kwargs.setdefault("device", model.device)
        store_kwargs.setdefault("dtype", model.dtype)
        if not any(k in store_kwargs for k in ("num_pages", "memory_budget")):
            store_kwargs["defer_pool"] = True
        store = OscarPagedStore(model, **store_kwargs)
    with oscar_continuous_batching(lambda config, device, dtype: store, model):
        yield store


def generate_batch(model, inputs, generation_config=None, continuous_batching_config=None, *, store=None,
                   **store_kwargs):
    """``model.generate_batch`` through OSCAR: :func:`paged_oscar` around one call (a fresh manager, no warmup)."""
    with paged_oscar(model, store, **store_kwargs):
        return model.generate_batch(inputs, generation_config, continuous_batching_config=continuous_batching_config,
                                    warmup=False)
