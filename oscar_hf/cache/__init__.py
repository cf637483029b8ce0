"""The cache: :class:`OscarCache`, a ``transformers.Cache`` whose full-attention layers are OSCAR layers
(:mod:`.layer`), their decode step compiled on CUDA, eager elsewhere; :class:`StaticOscarCache` fixes the
capacity. Layer kinds and storage: docs/cache.md; usage: docs/usage.md, "The cache in `generate`".
"""
from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from transformers.cache_utils import (Cache, DynamicLayer, DynamicSlidingWindowLayer,
                                      LinearAttentionAndFullAttentionLayer, LinearAttentionCacheLayerMixin,
                                      LinearAttentionAndSlidingWindowAttentionLayer,
                                      LinearAttentionAndStaticSlidingWindowAttentionLayer,
                                      LinearAttentionLayer, StaticSlidingWindowLayer)

from ..attention import enable_oscar
from ..compiled_step import install_step_hook
from ..config import (DUMMY_LAYER_TYPE, FULL_LAYER_TYPES, FULL_PRECISION_LAYER_TYPES, FULL_PRECISION_WHY,
                      SHARED_KV_LAYER_TYPE, SLIDING_LAYER_TYPES, STATE_LAYER_TYPES, ModelFingerprint, OscarConfig,
                      artifact_settings, hybrid_state_layers, starting_config)
from ..distributed import shard_cache_for_tensor_parallel
from ..layer_choice import LayerChoice, choose_layers, resolve_retrieval_heads
from ..rotations import OscarRotations
from .layer import GrowingLayer, OscarLayer
from .step_shared import StepShared
from .hybrid import OscarHybridLayer
from .io import DummyLayer, load_cache, save_cache  # (DummyLayer: None on Transformers 5.17)

__all__ = ["OscarCache", "StaticOscarCache", "OscarLayer", "OscarHybridLayer", "GrowingLayer",
           "resolve_retrieval_heads", "resolve_full_precision_heads"]
resolve_full_precision_heads = resolve_retrieval_heads  # the name before "retrieval heads" was the one name
# The layers' old names (one layer, compiled or not; "static" names only fixed capacity); importing them warns
RENAMED = {"StaticOscarLayer": "OscarLayer", "StaticOscarHybridLayer": "OscarHybridLayer",
           "CompiledOscarLayer": "OscarLayer", "CompiledOscarHybridLayer": "OscarHybridLayer"}
logger = logging.getLogger("oscar_hf")
_SAID: set[tuple[str, str]] = set()  # (architecture, layer kind) whose full-precision reason was logged


def __getattr__(name: str):
    if name in RENAMED:
        import warnings
        warnings.warn(f"oscar_hf.cache.{name} is now {RENAMED[name]} (one layer, compiled or not; \"static\" names "
                      "only the fixed-capacity StaticOscarCache)", FutureWarning, stacklevel=2)
        return globals()[RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


class OscarCache(Cache):
    """Drop-in KV cache for ``generate(cache=...)``: 2-bit OSCAR history, full-precision sink + recent.

    ``rotations``: an :class:`OscarRotations` or None for the artifact-free ``method``; ``overrides``:
    :class:`OscarConfig` fields on top of ``config`` / ``preset`` / the artifact's chosen settings. ``model_or_config``:
    the model (needed for tensor parallelism) or its config; its attention is routed through OSCAR. ``compile``:
    "auto" (``generate`` compiles the decode step on CUDA where every layer kind allows it), True, or False (every
    forward eager; the same :class:`OscarLayer` storage). Layer kinds: docs/usage.md, "Supported models".
    """

    def __init__(self, model_or_config, rotations: OscarRotations | None = None, config: OscarConfig | None = None, *,
                 preset: str | None = None, compile: bool | str = "auto", **overrides):
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
        config, default_group = starting_config(config, preset, rotations, overrides)
        is_model = isinstance(model_or_config, torch.nn.Module)
        model_config = model_or_config.config if is_model else model_or_config
        text_cfg = model_config.get_text_config(decoder=True)
        choice = choose_layers(model_config, rotations, config, default_group=default_group)
        config, rotations, fp = choice.config, choice.rotations, choice.fingerprint
        hybrid = hybrid_state_layers(text_cfg)  # attention + a state in one layer (Falcon-H1, Zamba)
        self.compiled = compiled_storage(compile, model_or_config if is_model else None, choice, hybrid,
                                         growable=self.max_cache_len_fixed is None)
        n_states = dict(number_of_states=getattr(text_cfg, "number_of_conv_states", 1))
        fixed = self.max_cache_len_fixed
        layers: list[Any] = []
        for i, kind in enumerate(fp.layer_types):
            state = n_states if i in hybrid else {}  # a "hybrid" layer's SSM state goes with it
            if kind in SLIDING_LAYER_TYPES:
                window = getattr(text_cfg, "sliding_window", None) if kind == "sliding_attention" else text_cfg.attention_chunk_size
                if self.compiled:  # a bounded buffer of the window's width, whatever the generation's length (crop
                    # refused once it rolls)
                    cls = LinearAttentionAndStaticSlidingWindowAttentionLayer if state else StaticSlidingWindowLayer
                    layers.append(cls(max_cache_len=fixed or 2**62, sliding_window=window, **state))
                else:
                    cls = LinearAttentionAndSlidingWindowAttentionLayer if state else DynamicSlidingWindowLayer
                    layers.append(cls(sliding_window=window, **state))
            elif kind in STATE_LAYER_TYPES:  # no per-token K/V: Transformers' own state layer (compileable as it is)
                layers.append(LinearAttentionLayer(**n_states))
            elif kind in FULL_LAYER_TYPES and choice.quantized(i):
                layers.append((OscarHybridLayer if state else OscarLayer)(
                    config, rotations.layers[i], i, retrieval_heads=choice.retrieval_heads.get(i, ()),
                    max_cache_len=fixed, compiled=self.compiled, **state))
            elif kind in FULL_LAYER_TYPES + FULL_PRECISION_LAYER_TYPES:  # skipped, MLA latents, KV sharing's stores
                state = state if kind in FULL_LAYER_TYPES else {}  # (compiled_storage refuses compiling with it)
                layers.append(GrowingLayer(fixed) if self.compiled
                              else LinearAttentionAndFullAttentionLayer(**state) if state else DynamicLayer())
            elif kind == DUMMY_LAYER_TYPE:  # caches nothing (KV sharing's reuse layers)
                layers.append(DummyLayer() if DummyLayer is not None else None)
            else:
                raise NotImplementedError(f"{fp.architecture}: layer type {kind!r} (layer {i}) is not supported by OscarCache")
        if None in layers:  # Transformers 5.17 (no DummyLayer) builds no layer for the trailing reuse layers either
            n = layers.index(None)
            if any(x is not None for x in layers[n:]):
                raise NotImplementedError(f"{fp.architecture}: layers that cache nothing before caching ones need "
                                          "Transformers' DummyLayer (transformers >= 5.2x)")
            layers = layers[:n]
        super().__init__(layers=layers)
        quantized = [x for x in layers if isinstance(x, OscarLayer)]
        if quantized:  # one decode forward's window mask and history length, computed by its first OSCAR layer
            step = StepShared(last_layer=max(x.layer_idx for x in quantized))
            for x in quantized:
                x.step = step
        # a compiled full-precision layer returns all C slots: every full-attention layer's mask is then its (C, 0)
        self._mask_layer = next((i for i, x in enumerate(layers) if isinstance(x, GrowingLayer)), None)
        self.oscar_config, self.rotations, self.fingerprint, self.layer_choice = config, rotations, fp, choice
        self._model_ref = weakref.ref(model_or_config) if is_model else None  # save's weights digest (io.py)
        self.tp_layout = None  # [tensor parallelism] set by oscar_hf/distributed.py: each rank keeps its own KV heads
        self._log_layer_plan(hybrid)
        if is_model:
            shard_cache_for_tensor_parallel(self, model_or_config)  # [tensor parallelism] no-op without TP
            if self.compiled:
                install_step_hook(model_or_config)  # host-side length and capacity growth around the compiled step
        enable_oscar(model_or_config)

    max_cache_len_fixed: int | None = None  # StaticOscarCache's capacity

    @property
    def is_compileable(self) -> bool:  # (compile=False: generate keeps every forward eager)
        # Cache.is_compileable written out: `super()` in a property breaks the compiled forward's graph where the model
        # reads it (torch 2.11's dynamo: 4 graphs a decode step, ~1 ms more host time at B=1)
        return self.compiled and len(self.layers) > 0 and all(layer.is_compileable for layer in self.layers)

    def layer_kinds(self) -> list[str]:
        """What each decoder layer got, in order: ``"oscar"`` / ``"oscar+state"``, ``"sliding"``, ``"state"``,
        ``"latent"``, ``"shared_kv"``, ``"full_precision"`` (skipped, no rotation) or ``"none"`` (caches nothing)."""
        named = {"latent_attention": "latent", "shared_kv_attention": "shared_kv", DUMMY_LAYER_TYPE: "none",
                 **dict.fromkeys(SLIDING_LAYER_TYPES, "sliding"), **dict.fromkeys(STATE_LAYER_TYPES, "state")}
        out = []
        for i, t in enumerate(self.fingerprint.layer_types):
            layer = self.layers[i] if i < len(self.layers) else None
            if isinstance(layer, OscarLayer):
                out.append("oscar+state" if isinstance(layer, LinearAttentionCacheLayerMixin) else "oscar")
            else:  # full attention (skipped, no rotation, exact) and unequal K/V widths: "full_precision"
                out.append(named.get(t, "full_precision"))
        return out

    @classmethod
    def from_pretrained(cls, name_or_path, model, config: OscarConfig | None = None, *, preset: str | None = None,
                        revision=None, cache_dir=None, local_files_only=False, token=None, **overrides) -> "OscarCache":
        """Load a rotation artifact (local dir or Hub repo id) and build a cache for ``model``."""
        rot = OscarRotations.from_pretrained(
            name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token)
        if (config is None and preset is None and "group_size" not in overrides
                and artifact_settings(rot.metadata) is None):
            # the group size the clips were chosen for: top level (hand-written artifacts) wins over calibrate()'s
            cal = rot.metadata.get("calibration")
            g = rot.metadata.get("group_size")
            g = cal.get("group_size") if g is None and isinstance(cal, dict) else g
            if g is not None:
                overrides["group_size"] = int(g)
        return cls(model, rot, config, preset=preset, **overrides)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if self._mask_layer is not None and isinstance(layer, OscarLayer):
            return self.layers[self._mask_layer].get_mask_sizes(query_length)  # the full-attention layers' one mask
        return super().get_mask_sizes(query_length, layer_idx)

    save = save_cache  # cache.save(directory)

    @classmethod
    def load(cls, directory, model, device=None, compile: bool | str = "auto") -> "OscarCache":
        """Load a cache written by :meth:`save` to continue exactly where it stopped (into either storage)."""
        return load_cache(cls, directory, model, device, compile=compile)

    def memory_report(self) -> dict[str, float]:
        """Bytes by part (summed over layers), bits per element, and the BF16 equivalent. ``full_precision_layers``:
        bytes of Transformers' own layers; ``*_layers`` counts: layers of each kind."""
        tot = dict.fromkeys(("sink", "recent", "history_codes", "history_meta", "history_elements", "retrieval_heads",
                             "allocated", "full_precision_layers"), 0)
        elements = 0
        for layer in self.layers:
            if hasattr(layer, "memory"):  # OscarLayer
                m = layer.memory()
                for k in tot.keys() & m.keys():
                    tot[k] += m[k]
                if layer.is_initialized:
                    elements += 2 * m["tokens"] * layer.num_kv_heads * layer.head_dim
            elif getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None:
                kv = layer.used() if isinstance(layer, GrowingLayer) else (layer.keys, layer.values)
                nb = sum(x.numel() * x.element_size() for x in kv)  # (an MLA latent's K and V widths differ)
                tot["full_precision_layers"] += nb
                tot["allocated"] += sum(x.numel() * x.element_size() for x in (layer.keys, layer.values))
                elements += sum(x.numel() for x in kv)
        kinds = self.layer_kinds()
        tot["quantized_layers"] = sum(k.startswith("oscar") for k in kinds)
        tot["latent_layers"] = kinds.count("latent")
        tot["shared_kv_layers"] = kinds.count("shared_kv")
        used = tot["total"] = (tot["sink"] + tot["recent"] + tot["history_codes"] + tot["history_meta"]
                               + tot["full_precision_layers"] + tot["retrieval_heads"])
        tot["bf16_equivalent"] = 2 * elements
        tot["bits_per_element"] = 8 * used / elements if elements else float("nan")
        tot["compression_vs_bf16"] = tot["bf16_equivalent"] / used if used else float("nan")
        # the history's average over the quantized layers' KV heads, retrieval heads at their stored bits
        q_layers = [layer for layer in self.layers if hasattr(layer, "memory")]
        n_heads = len(q_layers) * self.fingerprint.num_key_value_heads
        share = sum(len(layer.retrieval_heads) for layer in q_layers) / n_heads if n_heads else 0.0
        tot["history_bits_per_element"] = (self.oscar_config.history_bits(self.fingerprint.head_dim, share) if q_layers
                                           else float("nan"))  # (no INT2 history, e.g. every layer latent)
        return tot

    def _log_layer_plan(self, hybrid: set[int]) -> None:
        """Log which attention layers stay in full precision and why, one line per reason (a warning when nothing is
        quantized; debug after the first cache of the architecture)."""
        fp = self.fingerprint
        n_q = sum(k.startswith("oscar") for k in self.layer_kinds())
        for kind, why in FULL_PRECISION_WHY.items():
            idx = [i for i, t in enumerate(fp.layer_types) if t == kind]
            if idx:
                first = (fp.architecture, kind) not in _SAID
                _SAID.add((fp.architecture, kind))
                level = (logging.WARNING if n_q == 0 else logging.INFO) if first else logging.DEBUG
                logger.log(level, "OscarCache: %d of %d layers of %s kept in full precision (Transformers' own layer, "
                           "%s storage), %d quantized: %s", len(idx), fp.num_layers, fp.architecture,
                           "compiled" if self.compiled else "eager", n_q, why)
        if hybrid and n_q:
            logger.debug("OscarCache: %d hybrid layers of %s: OSCAR attention beside Transformers' linear-attention / "
                         "SSM state", len(hybrid), fp.architecture)

    def __repr__(self) -> str:
        n_q = sum(hasattr(layer, "memory") for layer in self.layers)
        c = self.oscar_config
        return (
            f"OscarCache(method={self.rotations.method!r}, quantized_layers={n_q}/{len(self.layers)}, sink={c.sink}, "
            f"recent={c.recent}, group_size={c.group_size}, seq_len={self.get_seq_length()})")


class StaticOscarCache(OscarCache):
    """:class:`OscarCache` with compiled storage of a fixed capacity of ``max_cache_len`` slots (left padding
    included); the batch size is fixed by the first forward."""

    def __init__(self, model_or_config, rotations=None, config: OscarConfig | None = None, *, max_cache_len: int,
                 **overrides):
        if max_cache_len is None or int(max_cache_len) < 1:
            raise ValueError("StaticOscarCache needs max_cache_len >= 1 (prompt + new tokens, padding included)")
        if overrides.pop("compile", True) is not True:
            raise ValueError("StaticOscarCache compiles its decode step; OscarCache(compile=False) runs eager forwards")
        self.max_cache_len_fixed = int(max_cache_len)  # (transformers 5.17's Cache has a read-only max_cache_len)
        super().__init__(model_or_config, rotations, config, compile=True, **overrides)

    @property
    def capacity(self) -> int:
        return self.max_cache_len_fixed

    @classmethod
    def load(cls, directory, model, device=None, *, max_cache_len: int | None = None) -> "StaticOscarCache":
        """Load a cache written by :meth:`save` into ``max_cache_len`` slots (default: the saved capacity, or the
        saved length plus headroom)."""
        return load_cache(cls, directory, model, device, compile=True, fixed_capacity=True, max_cache_len=max_cache_len)

    def __repr__(self) -> str:
        return super().__repr__().replace("OscarCache(", f"StaticOscarCache(max_cache_len={self.capacity}, ", 1)
