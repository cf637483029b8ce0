"""The name under which the installed Transformers takes the cache (``cache=`` from 5.24, ``past_key_values=``
before), read off the model, so that every call site runs warning-free on both: :func:`cache_kwargs`,
:func:`returned_cache`; docs/usage.md, "The cache in `generate`".
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from functools import lru_cache
from typing import Any

__all__ = ["CACHE_ARGUMENTS", "cache_argument", "cache_kwargs", "returned_cache"]

CACHE_ARGUMENTS = ("cache", "past_key_values")  # newest name first


@lru_cache(maxsize=None)
def _argument_of_class(cls: type) -> str:
    from transformers.generation.utils import GenerationMixin
    # a forward taking only **kwargs (PEFT): the name this Transformers' generate hands to every forward
    for fn in (getattr(cls, "forward", None), GenerationMixin.prepare_inputs_for_generation):
        try:  # inspect.signature follows __wrapped__ through Transformers' and accelerate's wrappers
            params = set(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = set()
        for name in CACHE_ARGUMENTS:
            if name in params:
                return name
    raise ValueError(f"{cls.__name__}.forward takes neither `cache` nor `past_key_values`, and this Transformers' "
                     "generate declares neither: not a decoder with a KV cache, or an unsupported Transformers version")


def cache_argument(model_or_cls: Any) -> str:
    """``"cache"`` where the forward of the model (or class) takes ``cache=``, else ``"past_key_values"``."""
    model = getattr(model_or_cls, "_orig_mod", model_or_cls)  # torch.compile's OptimizedModule
    return _argument_of_class(model if isinstance(model, type) else type(model))


def cache_kwargs(model_or_cls: Any, cache) -> dict[str, Any]:
    """``{"cache": cache}`` or ``{"past_key_values": cache}``, whichever ``model_or_cls`` takes."""
    return {cache_argument(model_or_cls): cache}


def returned_cache(outputs) -> Any:
    """The cache a forward or ``generate(..., return_dict_in_generate=True)`` returned, read from the output's keys
    (the deprecated attribute warns), or None."""
    if not isinstance(outputs, Mapping):  # ModelOutput is an OrderedDict of its non-None fields
        raise ValueError(f"expected a model output (ModelOutput), got {type(outputs).__name__}: call the model with "
                         "return_dict=True, or generate with return_dict_in_generate=True")
    present = set(outputs.keys())  # (on 5.24 even outputs.get("past_key_values") warns)
    return next((outputs[name] for name in CACHE_ARGUMENTS if name in present), None)
