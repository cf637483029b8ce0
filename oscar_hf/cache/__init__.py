"""The caches: :class:`OscarCache` (grows with the context) and :class:`StaticOscarCache` (preallocated, for
CUDA graphs), each a ``transformers.Cache`` whose full-attention layers are OSCAR layers.

Data flow: an artifact (:class:`~oscar_hf.OscarRotations`) -> a cache layer per decoder layer
(:mod:`.dynamic` / :mod:`.static`: write path + read) -> the registered attention function
(:mod:`oscar_hf.attention`) that hands each call to its layer; :mod:`.io` saves and loads a live cache.

    cache = OscarCache.from_pretrained("rotations_dir", model)   # or OscarCache(model, method="hadamard")
    model.generate(**inputs, cache=cache)   # Transformers without `cache=` (e.g. 5.17): past_key_values=cache
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from ..attention import enable_oscar
from ..config import FULL_LAYER_TYPES, SLIDING_LAYER_TYPES, ModelFingerprint, OscarConfig, validate_head_dim
from ..distributed import shard_cache_for_tensor_parallel
from ..quant import bits_per_element
from ..rotations import LayerRotation, OscarRotations
from .dynamic import OscarLayer
from .io import load_cache, save_cache
from .static import StaticOscarLayer

logger = logging.getLogger("oscar_hf")

__all__ = ["OscarCache", "StaticOscarCache", "OscarLayer", "StaticOscarLayer", "resolve_full_precision_heads"]


def resolve_full_precision_heads(config: OscarConfig, rotations: OscarRotations, fp: ModelFingerprint,
                                 skipped: set[int]) -> dict[int, tuple[int, ...]]:
    """``{layer: kv heads}`` kept in full precision (``OscarConfig.full_precision_heads``): the artifact's top-k
    retrieval heads or the given pairs, checked against the model; heads of unquantized layers (skipped, sliding,
    without rotation) are left out, being full precision already."""
    want = config.full_precision_heads
    pairs = rotations.top_retrieval_heads(want) if isinstance(want, int) else want
    out: dict[int, list[int]] = {}
    for i, h in pairs:
        if not 0 <= i < fp.num_layers or not 0 <= h < fp.num_key_value_heads:
            raise ValueError(f"full_precision_heads: ({i}, {h}) is not a (layer, kv_head) of this model "
                             f"({fp.num_layers} layers, {fp.num_key_value_heads} KV heads)")
        if i in rotations.layers and i not in skipped and fp.layer_types[i] in FULL_LAYER_TYPES:
            out.setdefault(i, []).append(h)
    return {i: tuple(sorted(hs)) for i, hs in out.items()}


class OscarCache(Cache):
    """Drop-in KV cache for ``generate(cache=...)`` (``past_key_values=`` on
    Transformers versions without ``cache=``, e.g. 5.17): 2-bit OSCAR
    history, full-precision sink + recent.

    ``OscarCache(model, rotations=None, config=None, *, preset=None, **overrides)`` with ``rotations`` an
    :class:`OscarRotations` (e.g. from ``scripts/calibrate.py``) or None for the artifact-free
    ``method`` ("identity" / "hadamard"); overrides are :class:`OscarConfig` fields. The cache routes
    the model's attention through OSCAR (:func:`~oscar_hf.enable_oscar`); the user's attention
    implementation still serves every layer OSCAR does not quantize. ``model_or_config`` is the model,
    or the model's own config (``model.config``, which the model reads at every forward; the model is
    needed for tensor parallelism, whose KV-head slices are read from its weights).
    Layers: full attention -> :class:`OscarLayer`; sliding-window / chunked -> Transformers'
    full-precision ``DynamicSlidingWindowLayer`` (bounded by its window already); ``skip_layers`` ->
    ``DynamicLayer``.
    """

    def __init__(self, model_or_config, rotations: OscarRotations | None = None, config: OscarConfig | None = None, *,
                 preset: str | None = None, **overrides):
        config = OscarConfig.build(config, preset, **overrides)
        is_model = isinstance(model_or_config, torch.nn.Module)
        model_config = model_or_config.config if is_model else model_or_config
        text_cfg = model_config.get_text_config(decoder=True)
        if rotations is None:
            rotations = OscarRotations.builtin(model_config, config.method)
        else:
            rotations.check_compatible(model_config)
        fp = ModelFingerprint.from_config(model_config)
        config = config.for_head_dim(fp.head_dim)  # group_size=None (the "paper" preset): one group per head
        validate_head_dim(fp, config.group_size)
        cal_g = rotations.metadata.get("group_size")
        if cal_g is not None and int(cal_g) != config.group_size:
            logger.warning("rotations were calibrated for group_size=%s, cache uses %s", cal_g, config.group_size)
        for name in ("softcap", "attn_logit_softcapping"):
            if getattr(text_cfg, name, None):
                raise NotImplementedError(f"{fp.architecture}: attention logit soft-capping ({name}) is not supported by OSCAR")
        skipped = config.skipped(fp.num_layers)
        fp_heads = resolve_full_precision_heads(config, rotations, fp, skipped)
        if fp_heads:  # the saved / reported config names the heads, not "the top k"
            config = config.replace(full_precision_heads=tuple(sorted((i, h) for i, hs in fp_heads.items() for h in hs)))
        layers: list[Any] = []
        for i, kind in enumerate(fp.layer_types):
            if kind in SLIDING_LAYER_TYPES:
                window = getattr(text_cfg, "sliding_window", None) if kind == "sliding_attention" else text_cfg.attention_chunk_size
                layers.append(self._sliding_layer(window))
            elif kind in FULL_LAYER_TYPES:
                if i in skipped or i not in rotations.layers or len(fp_heads.get(i, ())) == fp.num_key_value_heads:
                    layers.append(self._full_precision_layer())
                elif i in fp_heads:
                    layers.append(self._oscar_layer(config, rotations.layers[i], i, fp_heads[i]))
                else:
                    layers.append(self._oscar_layer(config, rotations.layers[i], i))
            else:
                raise NotImplementedError(f"{fp.architecture}: layer type {kind!r} (layer {i}) is not supported by OscarCache")
        super().__init__(layers=layers)
        self.oscar_config, self.rotations, self.fingerprint = config, rotations, fp
        self.tp_layout = None  # [tensor parallelism] set by oscar_hf/distributed.py: each rank keeps its own KV heads
        if is_model:
            shard_cache_for_tensor_parallel(self, model_or_config)  # [tensor parallelism] no-op without TP
        enable_oscar(model_or_config)

    # Layer factories (the static-capacity subclass, StaticOscarCache, overrides them).
    def _sliding_layer(self, window: int):
        return DynamicSlidingWindowLayer(sliding_window=window)

    def _full_precision_layer(self):
        return DynamicLayer()

    def _oscar_layer(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, fp_heads=()):
        return OscarLayer(config, rotation, layer_idx, fp_heads)

    @classmethod
    def from_pretrained(cls, name_or_path, model, config: OscarConfig | None = None, *, preset: str | None = None,
                        revision=None, cache_dir=None, local_files_only=False, token=None, **overrides) -> "OscarCache":
        """Load a rotation artifact (local dir or Hub repo id) and build a cache for ``model``."""
        rot = OscarRotations.from_pretrained(
            name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token
        )
        if config is None and preset is None and "group_size" in rot.metadata and "group_size" not in overrides:
            overrides["group_size"] = int(rot.metadata["group_size"])
        return cls(model, rot, config, preset=preset, **overrides)

    # ------------------------------------------------------------------ persistence
    def save(self, directory) -> None:
        """Write the live cache (INT2 history, windows, positions, rotations) to ``directory``."""
        save_cache(self, directory)

    @classmethod
    def load(cls, directory, model, device=None) -> "OscarCache":
        """Load a cache written by :meth:`save` to continue generation exactly where it stopped."""
        return load_cache(cls, directory, model, device)

    # ------------------------------------------------------------------ reporting
    def memory_report(self) -> dict[str, float]:
        """Bytes by part (summed over layers), bits per element, and the BF16 DynamicCache equivalent."""
        tot = dict(sink=0, recent=0, history_codes=0, history_meta=0, history_elements=0, full_precision_heads=0,
                   allocated=0, full_precision_layers=0)
        elements = 0
        for layer in self.layers:
            if hasattr(layer, "memory"):  # OscarLayer and the static StaticOscarLayer
                m = layer.memory()
                for k in ("sink", "recent", "history_codes", "history_meta", "history_elements", "allocated"):
                    tot[k] += m[k]
                tot["full_precision_heads"] += m.get("full_precision_heads", 0)
                if layer.is_initialized:
                    elements += 2 * m["tokens"] * layer.num_kv_heads * layer.head_dim
            elif getattr(layer, "is_initialized", False) and layer.keys is not None:
                nb = layer.keys.numel() * layer.keys.element_size() * 2
                tot["full_precision_layers"] += nb
                tot["allocated"] += nb
                elements += 2 * layer.keys.numel()
        used = (tot["sink"] + tot["recent"] + tot["history_codes"] + tot["history_meta"] + tot["full_precision_layers"]
                + tot["full_precision_heads"])
        tot["total"] = used
        tot["bf16_equivalent"] = 2 * elements
        tot["bits_per_element"] = 8 * used / elements if elements else float("nan")
        tot["compression_vs_bf16"] = tot["bf16_equivalent"] / used if used else float("nan")
        tot["history_bits_per_element"] = bits_per_element(
            self.fingerprint.head_dim, self.oscar_config.group_size, self.oscar_config.torch_meta_dtype
        )
        return tot

    def __repr__(self) -> str:
        n_q = sum(hasattr(layer, "memory") for layer in self.layers)
        c = self.oscar_config
        return (
            f"OscarCache(method={self.rotations.method!r}, quantized_layers={n_q}/{len(self.layers)}, sink={c.sink}, "
            f"recent={c.recent}, group_size={c.group_size}, seq_len={self.get_seq_length()})"
        )


class StaticOscarCache(OscarCache):
    """:class:`OscarCache` with storage preallocated to ``max_cache_len`` slots
    (prompt + new tokens, left padding included), so that ``generate`` compiles the decode step
    (CUDA graphs). Sliding-window layers use Transformers' ``StaticSlidingWindowLayer``, skipped
    layers ``StaticLayer``. The batch size is taken from the first forward and fixed."""

    def __init__(self, model_or_config, rotations=None, config: OscarConfig | None = None, *, max_cache_len: int,
                 **overrides):
        if max_cache_len is None or int(max_cache_len) < 1:
            raise ValueError("StaticOscarCache needs max_cache_len >= 1 (prompt + new tokens, padding included)")
        self.capacity = int(max_cache_len)  # (transformers 5.17's Cache has a read-only max_cache_len property)
        super().__init__(model_or_config, rotations, config, **overrides)
        if self.oscar_config.key_offset != "calibrated":
            raise NotImplementedError("StaticOscarCache supports key_offset='calibrated' only; "
                                      "key_offset='prefill' needs OscarCache")

    def _sliding_layer(self, window: int):
        return StaticSlidingWindowLayer(max_cache_len=self.capacity, sliding_window=window)

    def _full_precision_layer(self):
        return StaticLayer(max_cache_len=self.capacity)

    def _oscar_layer(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, fp_heads=()):
        if fp_heads:
            raise NotImplementedError("StaticOscarCache does not support full_precision_heads; use OscarCache")
        return StaticOscarLayer(config, rotation, layer_idx, self.capacity)

    def save(self, directory) -> None:
        raise NotImplementedError("saving a live StaticOscarCache is not supported: use OscarCache.save")

    def __repr__(self) -> str:
        return super().__repr__().replace("OscarCache(", f"StaticOscarCache(max_cache_len={self.capacity}, ", 1)
