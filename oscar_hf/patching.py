"""Route a model's attention through OSCAR without per-architecture code: attention functions ``<prefix><base>``
(e.g. ``oscar_sdpa``) call a *handler*, which serves the call or returns ``NotImplemented`` for the user's ``<base>``,
and the mask builder is registered under the same name; docs/usage.md, "The cache in `generate`".
"""
from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

# Implementations we know how to wrap. "eager" is not in ALL_ATTENTION_FUNCTIONS: it is each
# modeling file's own `eager_attention_forward`.
BASE_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")

_HANDLERS: dict[str, Callable] = {}


def base_attention_function(module, base: str) -> Callable:
    """The user's original attention function for ``module`` (``eager`` resolved per modeling file)."""
    if base == "eager":
        fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if fn is None:
            raise NotImplementedError(
                f"{type(module).__name__} has no module-level eager_attention_forward; load the model with "
                "attn_implementation='sdpa' to use OSCAR")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def _wrapped(module, query, key, value, attention_mask, *args, _prefix: str, _base: str, **kwargs):
    cache = kwargs.get("cache")
    if getattr(cache, "updates_in_attention", False) and isinstance(key, torch.Tensor):
        # Transformers 5.20 - 5.23: the attention function, not the layer, updates the paged cache
        key, value = cache.update(key, value, module.layer_idx, kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k != "cache"}
    out = _HANDLERS[_prefix](module, query, key, value, attention_mask, *args, base=_base, **kwargs)
    if out is NotImplemented:
        return base_attention_function(module, _base)(module, query, key, value, attention_mask, *args, **kwargs)
    return out


def register_handler(prefix: str, handler: Callable) -> None:
    """Register ``<prefix><base>`` attention + mask functions for every known base implementation."""
    _HANDLERS[prefix] = handler
    for base in BASE_IMPLEMENTATIONS:
        name = prefix + base
        AttentionInterface.register(name, functools.partial(_wrapped, _prefix=prefix, _base=base))
        mask_base = base if base in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping else "sdpa"
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS._global_mapping[mask_base])


def split_name(impl: str | None) -> tuple[str | None, str]:
    """``"oscar_sdpa"`` -> ``("oscar_", "sdpa")``; unprefixed names -> ``(None, name)``."""
    impl = impl or "sdpa"
    for p in _HANDLERS:
        if impl.startswith(p):
            return p, impl[len(p) :]
    return None, impl


def attention_configs(target) -> list:
    """The configs that name an attention implementation, each once: a model's modules' own, or a config and its
    sub-configs at any depth (``config.sub_configs``)."""
    is_model = isinstance(target, torch.nn.Module)
    seen, out, todo = set(), [], [getattr(m, "config", None) for m in target.modules()] if is_model else [target]
    while todo:
        cfg = todo.pop()
        if cfg is None or id(cfg) in seen or not hasattr(cfg, "_attn_implementation"):
            continue
        seen.add(id(cfg))
        out.append(cfg)
        if not is_model:
            todo.extend(getattr(cfg, key, None) for key in getattr(cfg, "sub_configs", {}))
    return out


def switch_attention(target, prefix: str) -> str:
    """Switch ``target`` (a model, or its config, read at every forward) to ``<prefix><its implementation>``;
    returns the new name. Idempotent."""
    if prefix not in _HANDLERS:
        raise ValueError(f"no attention handler registered for prefix {prefix!r}")
    is_model = isinstance(target, torch.nn.Module)
    current = (target.config if is_model else target)._attn_implementation
    old_prefix, base = split_name(current)
    if old_prefix == prefix:
        return current
    if base not in BASE_IMPLEMENTATIONS:
        raise ValueError(
            f"OSCAR cannot wrap attn_implementation={current!r}; load the model with one of {BASE_IMPLEMENTATIONS}")
    name = prefix + base
    if is_model and hasattr(target, "set_attn_implementation"):
        target.set_attn_implementation(name)
    # Modules may hold their own config objects (sub-configs); make every one agree.
    for cfg in attention_configs(target):
        if split_name(cfg._attn_implementation)[1] == base or cfg._attn_implementation is None:
            cfg._attn_implementation_internal = name
    return name


def restore_attention(model) -> str:
    """Restore the user's original attention implementation."""
    _, base = split_name(model.config._attn_implementation)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(base)
    for cfg in attention_configs(model):
        cfg._attn_implementation_internal = split_name(cfg._attn_implementation)[1]
    return base


@contextlib.contextmanager
def patched(model, prefix: str):
    """Temporarily route ``model``'s attention through ``prefix``'s handler."""
    before = model.config._attn_implementation
    switch_attention(model, prefix)
    try:
        yield model
    finally:
        if split_name(before)[0] is None:
            restore_attention(model)
        else:
            model.set_attn_implementation(before)
