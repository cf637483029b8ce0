"""The name under which the installed Transformers takes the cache, read off the model itself. Transformers 5.24
renamed it (``generate(cache=...)``, outputs carry ``.cache``; ``past_key_values=`` warns, removal in 6.0); older 5.x
(5.17 on our GPU machine) only knows ``past_key_values=``. Every call site of ours goes through these two helpers so
that it runs warning-free on both::

    out = model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=64)
    out = model(ids, **cache_kwargs(model, cache), use_cache=True)
    cache = returned_cache(out)   # out.cache or out.past_key_values
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

__all__ = ["CACHE_ARGUMENTS", "cache_argument", "cache_kwargs", "returned_cache"]

CACHE_ARGUMENTS = ("cache", "past_key_values")  # newest name first


def _parameters(fn) -> set[str]:
    # inspect.signature follows __wrapped__, i.e. through Transformers' deprecate_kwarg / can_return_tuple
    # wrappers and accelerate's forward hooks, down to the function that declares the real parameters.
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


@lru_cache(maxsize=None)
def _argument_of_class(cls: type) -> str:
    params = _parameters(getattr(cls, "forward", None))
    for name in CACHE_ARGUMENTS:
        if name in params:
            return name
    # A forward that takes only **kwargs (a wrapper such as PEFT's): the name this Transformers' generate
    # hands to every model forward (GenerationMixin.prepare_inputs_for_generation declares it).
    from transformers.generation.utils import GenerationMixin
    params = _parameters(GenerationMixin.prepare_inputs_for_generation)
    for name in CACHE_ARGUMENTS:
        if name in params:
            return name
    raise ValueError(f"{cls.__name__}.forward takes neither `cache` nor `past_key_values`, and this Transformers' "
                     "generate declares neither: not a decoder with a KV cache, or an unsupported Transformers version")


def cache_argument(model_or_cls: Any) -> str:
    """``"cache"`` where the model's forward takes ``cache=`` (recent Transformers), else ``"past_key_values"``.

    ``model_or_cls``: a model (a ``torch.compile``'d one too) or its class. Read from the forward's signature
    (``generate`` of the same Transformers version hands the cache to the forward under the same name)."""
    model = getattr(model_or_cls, "_orig_mod", model_or_cls)  # torch.compile's OptimizedModule
    return _argument_of_class(model if isinstance(model, type) else type(model))


def cache_kwargs(model_or_cls: Any, cache) -> dict[str, Any]:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever ``model_or_cls`` takes, for
    ``model.generate(..., **cache_kwargs(model, cache))`` and ``model(..., **cache_kwargs(model, cache))``."""
    return {cache_argument(model_or_cls): cache}


def returned_cache(outputs) -> Any:
    """The cache a forward, or ``generate(..., return_dict_in_generate=True)``, returned: ``outputs.cache`` (recent
    Transformers) or ``outputs.past_key_values`` (older), read from the output's keys (on recent versions that
    attribute is a deprecated alias that warns); None when it returned none (``use_cache=False``)."""
    if not isinstance(outputs, Mapping):  # ModelOutput is an OrderedDict of its non-None fields
        raise ValueError(f"expected a model output (ModelOutput), got {type(outputs).__name__}: call the model with "
                         "return_dict=True, or generate with return_dict_in_generate=True")
    present = set(outputs.keys())  # (on 5.24, even outputs.get("past_key_values") logs that deprecation warning)
    for name in CACHE_ARGUMENTS:
        if name in present:
            return outputs[name]
    return None
