"""The host side of the compiled decode step: a compiled step cannot allocate or read the length back, so the host
advances each layer's ``host_len`` and grows its storage before a one-token step, runs multi-token forwards through
the plain model, and adapts ``generate``'s first allocation and mask; docs/cache.md, "The compiled layer".
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


def _expect_length(original, generation_config, model_kwargs, *args, **kwargs):
    """``generate``'s ``_prepare_cache_for_generation``, telling the cache's layers ``max_cache_length`` first."""
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    expected = kwargs.get("max_cache_length", args[2] if len(args) > 2 else None)
    if isinstance(expected, int) and expected > 0:
        for layer in _oscar_layers(cache):
            layer.expected_len = expected
    return original(generation_config, model_kwargs, *args, **kwargs)


def _mask_unread(cache, inputs_embeds) -> bool:
    """Whether a one-token step's mask would go unread: every layer of ``cache`` a compiled OSCAR layer past its
    prefill that sizes no mask (``OscarLayer.get_mask_sizes``: compiled, no fixed capacity)."""
    from .cache.layer import OscarLayer  # (here: the cache package imports this module)

    layers = getattr(getattr(cache, "self_attention_cache", cache), "layers", None)
    return (inputs_embeds is not None and inputs_embeds.shape[1] == 1 and bool(layers)
            and all(isinstance(x, OscarLayer) and x.compiled and x.pad_known and not x.fixed_capacity for x in layers))


def _decode_mask(original, *args, **kwargs):
    """``generate``'s ``create_masks_for_generate``, or None where :func:`_mask_unread`."""
    if _mask_unread(kwargs.get("cache", kwargs.get("past_key_values")), kwargs.get("inputs_embeds")):
        return None
    return original(*args, **kwargs)


def install_step_hook(model) -> None:
    """Wrap ``model.get_compiled_call``, ``_prepare_cache_for_generation`` and ``create_masks_for_generate`` (which
    ``generate`` looks up on the model) on the instance. Idempotent."""
    if getattr(model, _MARK, False) or not hasattr(model, "get_compiled_call"):
        return
    original = model.get_compiled_call

    @functools.wraps(original)
    def get_compiled_call(*args, **kwargs):
        return functools.partial(_step, model, original(*args, **kwargs))

    model.get_compiled_call = get_compiled_call
    if hasattr(model, "_prepare_cache_for_generation"):
        model._prepare_cache_for_generation = functools.partial(_expect_length, model._prepare_cache_for_generation)
    from transformers import masking_utils

    masks = getattr(model, "create_masks_for_generate", masking_utils.create_masks_for_generate)
    model.create_masks_for_generate = functools.partial(_decode_mask, masks)
    setattr(model, _MARK, True)
