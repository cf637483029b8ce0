"""Which storage an :class:`~oscar_hf.OscarCache` gets, compiled or eager; decided once per cache."""
from __future__ import annotations

import logging

from ..config import DUMMY_LAYER_TYPE, FULL_LAYER_TYPES, SHARED_KV_LAYER_TYPE, SLIDING_LAYER_TYPES, STATE_LAYER_TYPES
from ..config import ModelFingerprint
from ..layer_choice import LayerChoice

logger = logging.getLogger("oscar_hf")

# layer kinds that compile="auto" compiles on CUDA: those measured on a GPU (docs/results.md, "Other architectures");
# the others need compile=True
AUTO_COMPILED_LAYER_TYPES = (FULL_LAYER_TYPES + SLIDING_LAYER_TYPES + STATE_LAYER_TYPES
                             + (SHARED_KV_LAYER_TYPE, DUMMY_LAYER_TYPE))
_SAID_EAGER: set[str] = set()  # the reasons already logged


def not_auto_compiled(fp: ModelFingerprint) -> str | None:
    """The unmeasured layer kinds that keep ``compile="auto"`` eager for this model, or None."""
    other = sorted({k for k in fp.layer_types if k not in AUTO_COMPILED_LAYER_TYPES})
    return f"{' / '.join(other)} layers" if other else None


def model_on_cuda(model) -> bool:
    """Whether ``compile="auto"`` sees a model on CUDA (any of its parameters)."""
    return model is not None and any(p.is_cuda for p in model.parameters())


def compiled_storage(compile: bool | str, model, choice: LayerChoice, hybrid: set[int], growable: bool) -> bool:
    """Whether the full-attention layers get compiled storage (``model`` None for a config; ``growable``: no fixed
    capacity)."""
    if compile is False:
        return False
    why = None
    # a hybrid layer kept in full precision would need a growing hybrid layer, which does not exist
    if choice.kept_full_attention & set(hybrid):
        why = "a hybrid (attention + state) layer kept in full precision (skip_layers, BF16 retrieval heads)"
    elif model is not None and any(m._backward_hooks or m._backward_pre_hooks for m in model.modules()):
        # Transformers 5.17's tensor-parallel layers register these, and dynamo refuses them
        why = "a model with module backward hooks (tensor parallelism on Transformers 5.17), which torch.compile cannot trace"
    if compile == "auto":
        on_cuda = model_on_cuda(model)
        # tensor parallelism compiles (checked on the CPU) but is not measured on GPUs yet
        tp = model is not None and (getattr(model, "_tp_size", None) or 1) > 1
        unmeasured = on_cuda and growable and ("tensor parallelism" if tp else not_auto_compiled(choice.fingerprint))
        say = (f"OscarCache: eager storage, not compiled (the compiled decode step does not support {why})"
               if on_cuda and why else
               f"OscarCache: eager storage, not compiled, for a model with {unmeasured} (compile=True compiles it; "
               "not measured on a GPU, so not the default)" if unmeasured else None)
        if say and say not in _SAID_EAGER:  # once per process each
            _SAID_EAGER.add(say)
            logger.warning(say)
        return on_cuda and why is None and not unmeasured
    if why:
        raise ValueError(f"OscarCache(compile=True) does not support {why}")
    return True
