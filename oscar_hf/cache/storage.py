"""Which storage an :class:`~oscar_hf.OscarCache` gets: device-resident buffers that ``generate`` compiles the decode
step over (:class:`~oscar_hf.cache.compiled.CompiledOscarLayer`), or the eager reference
(:class:`~oscar_hf.cache.dynamic.OscarLayer`); decided once per cache from the model and its :class:`LayerChoice`."""
from __future__ import annotations

import logging

from ..config import DUMMY_LAYER_TYPE, FULL_LAYER_TYPES, SHARED_KV_LAYER_TYPE, SLIDING_LAYER_TYPES, STATE_LAYER_TYPES
from ..config import ModelFingerprint
from ..layer_choice import LayerChoice

logger = logging.getLogger("oscar_hf")

# layer kinds that compile="auto" compiles on CUDA: the layouts a GPU run measured compiled against the eager storage
# (docs/results.md, "Other architectures": Gemma 2 / 3, gpt-oss, Qwen3-Next, Falcon-H1 2-5x the eager storage and ~2x
# compiled StaticCache at B=8/32K); hybrid layers count as full attention; KV sharing: the store layer and the reuse
# layers' dummies (Gemma 3n). The others need compile=True.
AUTO_COMPILED_LAYER_TYPES = (FULL_LAYER_TYPES + SLIDING_LAYER_TYPES + STATE_LAYER_TYPES
                             + (SHARED_KV_LAYER_TYPE, DUMMY_LAYER_TYPE))
_SAID_EAGER: set[str] = set()  # the reasons already logged (once per process each)


def not_auto_compiled(fp: ModelFingerprint) -> str | None:
    """What keeps ``compile="auto"`` on the eager storage for this model on CUDA (``None``: nothing): layer kinds
    the compiled storage serves (``compile=True``) but that no GPU run has measured -- MLA latents and values of
    another head size (full precision both)."""
    other = sorted({k for k in fp.layer_types if k not in AUTO_COMPILED_LAYER_TYPES})
    return f"{' / '.join(other)} layers" if other else None


def model_on_cuda(model) -> bool:
    """Whether ``compile="auto"`` sees a model on CUDA (any of its parameters)."""
    return model is not None and any(p.is_cuda for p in model.parameters())


def _say_eager_once(message: str) -> None:
    """A warning, once per process for each message: a CUDA model whose decode step ``generate`` will not compile."""
    if message not in _SAID_EAGER:
        _SAID_EAGER.add(message)
        logger.warning(message)


def compiled_storage(compile: bool | str, model, choice: LayerChoice, hybrid: set[int], growable: bool) -> bool:
    """Whether the full-attention layers get device-resident storage (``compile`` as :class:`~oscar_hf.OscarCache`
    takes it; ``model`` None when the cache was given a config; ``growable``: no fixed capacity)."""
    if compile is False:
        return False
    why = None
    # full-attention layers kept in full precision are GrowingLayers beside the OSCAR layers, except a hybrid one:
    # its state would need a growing hybrid layer, which does not exist
    if choice.kept_full_attention & set(hybrid):
        why = "a hybrid (attention + state) layer kept in full precision (skip_layers, BF16 retrieval heads)"
    elif model is not None and any(m._backward_hooks or m._backward_pre_hooks for m in model.modules()):
        # Transformers 5.17's tensor-parallel layers register these; dynamo refuses them ("Module-level backwards
        # hooks require compiled autograd"), so generate's compiled step would fail (5.24's TP layers do not)
        why = "a model with module backward hooks (tensor parallelism on Transformers 5.17), which torch.compile cannot trace"
    if compile == "auto":
        on_cuda = model_on_cuda(model)
        # tensor parallelism compiles (each rank's layers hold its own KV heads; checked on the CPU under
        # torchrun + gloo) but is not measured on GPUs yet
        tp = model is not None and (getattr(model, "_tp_size", None) or 1) > 1
        if on_cuda and why:
            _say_eager_once(f"OscarCache: eager storage, not compiled (the compiled decode step does not support "
                            f"{why})")
        elif on_cuda and growable and (unmeasured := "tensor parallelism" if tp else not_auto_compiled(choice.fingerprint)):
            _say_eager_once(f"OscarCache: eager storage, not compiled, for a model with {unmeasured} "
                            f"(compile=True compiles it; not measured on a GPU, so not the default)")
            return False
        return on_cuda and why is None
    if why:
        raise ValueError(f"OscarCache(compile=True) does not support {why}")
    return True
