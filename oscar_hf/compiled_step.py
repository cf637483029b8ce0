"""The host side of the compiled decode step (docs/cache.md, the compiled layer).

``generate`` compiles ``model.__call__`` by itself when the cache is compileable and runs every decode step through
it. A compiled step cannot allocate and must not read the cache's length back from the device (a host stall per
step), so :class:`~oscar_hf.OscarCache` wraps the compiled callable of a model it serves:

* before a one-token step each OSCAR layer learns its ``host_len`` on the host and grows its storage to the next
  capacity bucket if the token would not fit (the first growth recompiles once, capacity symbolic; each later bucket
  records one more CUDA graph);
* a multi-token forward (chunked prefill, assisted decoding's verification) runs through the plain model: GEMM-bound,
  and its shapes change every call;
* when ``generate`` prepares its cache, each layer learns ``max_cache_length`` so that its first allocation holds the
  whole answer where that is within reach (:func:`~oscar_hf.cache.compiled.capacity_for`).

A cache without OSCAR layers goes straight to the compiled call, so the wrappers stay on the model once installed.
"""
from __future__ import annotations

import functools

_MARK = "_oscar_compiled_step"


def _oscar_layers(cache) -> list:
    cache = getattr(cache, "self_attention_cache", cache)  # (encoder-decoder caches)
    return [layer for layer in getattr(cache, "layers", ()) if hasattr(layer, "advance")]


def _step(model, compiled, *args, **kwargs):
    layers = _oscar_layers(kwargs.get("cache", kwargs.get("past_key_values")))
    if not layers:
        return compiled(*args, **kwargs)
    x = kwargs.get("input_ids")
    x = kwargs.get("inputs_embeds") if x is None else x
    if x is None or x.shape[1] != 1:
        return model(*args, **kwargs)
    for layer in layers:
        layer.advance(1)
        layer.announced = True
    try:
        return compiled(*args, **kwargs)
    finally:
        for layer in layers:
            layer.announced = False


def cpu_compile_config():
    """``generate``'s own compile route taken on the CPU (it compiles on CUDA only unless told): fullgraph (a graph
    break is an error), dynamo with the eager backend. The compiled storage's logic, checked where there is no GPU."""
    from transformers import CompileConfig
    cc = CompileConfig(fullgraph=True, backend="eager", mode=None)
    cc._compile_all_devices = True
    return cc


def _expect_length(original, generation_config, model_kwargs, *args, **kwargs):
    """``generate``'s ``_prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, batch_size,
    max_cache_length)`` (Transformers 5.17-5.24), telling a user cache's growing layers ``max_cache_length`` first."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    expected = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
    if isinstance(expected, int) and expected > 0:
        for layer in _oscar_layers(cache):
            layer.expected_len = expected
    return original(generation_config, model_kwargs, *args, **kwargs)


def install_step_hook(model) -> None:
    """Wrap ``model.get_compiled_call`` and ``model._prepare_cache_for_generation`` (instance attributes; the class
    is untouched). Idempotent."""
    if getattr(model, _MARK, False) or not hasattr(model, "get_compiled_call"):
        return
    original = model.get_compiled_call

    @functools.wraps(original)
    def get_compiled_call(*args, **kwargs):
        return functools.partial(_step, model, original(*args, **kwargs))

    model.get_compiled_call = get_compiled_call
    if hasattr(model, "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = functools.partial(_expect_length, model._prepare_cache_for_generation)
    setattr(model, _MARK, True)
