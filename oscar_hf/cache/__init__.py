"""The cache: :class:`OscarCache`, a ``transformers.Cache`` whose full-attention layers are OSCAR layers; on CUDA
its storage is device-resident and ``generate`` compiles the decode step by itself (:mod:`.static`, growing in
capacity buckets), elsewhere it is the eager reference (:mod:`.dynamic`). :class:`StaticOscarCache` fixes the
capacity (``max_cache_len``).

The eager layer keeps a layout of its own (a growing tail instead of the compiled layer's fixed sink + ring) because
it reads any attention mask exactly (holes, custom 4D masks) and equals a ``DynamicCache`` bit for bit until its first
demotion; both layers, and the serving store, share one :class:`~oscar_hf.cache.params.LayerParams` per layer, the
write kernels and the reads (the INT2 decode op, the retrieval heads' kernel). The compiled layer and the serving
store also share one storage model, written once in :mod:`.window`: a sink + ring window, and a history of INT2 rows
and the retrieval heads' coded rows (``LayerParams.encode_history``), addressed as rows or as pages.

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
    LinearAttentionLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from ..attention import enable_oscar
from ..compiled_step import install_step_hook
from ..config import FULL_LAYER_TYPES, SLIDING_LAYER_TYPES, STATE_LAYER_TYPES, ModelFingerprint, OscarConfig, validate_head_dim
from ..distributed import shard_cache_for_tensor_parallel
from ..rotations import LayerRotation, OscarRotations
from .dynamic import OscarLayer
from .io import load_cache, save_cache
from .static import StaticOscarLayer

logger = logging.getLogger("oscar_hf")

__all__ = ["OscarCache", "StaticOscarCache", "OscarLayer", "StaticOscarLayer", "resolve_full_precision_heads"]


def resolve_full_precision_heads(config: OscarConfig, rotations: OscarRotations, fp: ModelFingerprint,
                                 skipped: set[int]) -> dict[int, tuple[int, ...]]:
    """``{layer: kv heads}`` kept in full precision (``OscarConfig.full_precision_heads``), checked against the model:

    * ``"auto"``: the artifact's retrieval heads scoring at least ``config.retrieval_threshold``, best first, at most
      ``config.full_precision_head_budget(...)`` of them (average history bits within ``max_history_bits``); none
      when the rotations have no retrieval scores (built-in methods, artifacts calibrated without probes);
    * an int ``k``: the artifact's ``k`` best retrieval heads; pairs: those heads.

    Heads of unquantized layers (skipped, sliding, without rotation) are left out, being full precision already."""
    want = config.full_precision_heads
    if want == "auto":
        # the quantized layers' KV heads: the ones the INT2 history (and the bit budget) is about
        quantized = [i for i in sorted(rotations.layers)
                     if i not in skipped and 0 <= i < fp.num_layers and fp.layer_types[i] in FULL_LAYER_TYPES]
        scores = rotations.retrieval_scores
        if scores is None:
            logger.info("full_precision_heads='auto': the %s rotations have no retrieval scores, no full-precision "
                        "heads", rotations.method)
            pairs = ()
        else:
            budget = config.full_precision_head_budget(fp.head_dim, len(quantized) * fp.num_key_value_heads)
            s = scores[quantized].flatten()  # [len(quantized) * Hk]
            order = torch.argsort(s, descending=True, stable=True)
            hk = fp.num_key_value_heads
            passing = [(quantized[int(j) // hk], int(j) % hk) for j in order if s[j] >= config.retrieval_threshold]
            pairs = tuple(passing[:budget])
            logger.info("full_precision_heads='auto': %d of %d heads score >= %.2f, budget %d (history <= %.2f bits): "
                        "%s", len(passing), s.numel(), config.retrieval_threshold, budget, config.max_history_bits,
                        list(pairs))
    elif isinstance(want, int):
        pairs = rotations.top_retrieval_heads(want)
    else:
        pairs = want
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

    ``compile``: "auto" (default) keeps the storage on the device in fixed-address buffers
    (:class:`StaticOscarLayer`, capacity growing in buckets) when the model is on CUDA and every layer it has can
    be compiled (full attention, no ``skip_layers``, not tensor parallel), so that ``generate`` compiles the decode
    step with CUDA graphs by itself; True asks for that storage anywhere (the CPU runs its torch reference), and also
    serves models with sliding-window / chunked layers (Transformers' ``StaticSlidingWindowLayer``, a buffer of the
    window's width, beside the compiled OSCAR layers; the compiled step is traced up to three times as that layer
    fills, and it cannot ``crop`` once it rolls); False keeps the eager :class:`OscarLayer`.
    """

    def __init__(self, model_or_config, rotations: OscarRotations | None = None, config: OscarConfig | None = None, *,
                 preset: str | None = None, compile: bool | str = "auto", **overrides):
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
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
        if getattr(text_cfg, "kv_lora_rank", None):  # DeepSeek-V2/V3, Kimi, GLM-4-MoE-Lite, ...
            raise NotImplementedError(
                f"{fp.architecture}: multi-head latent attention (MLA, kv_lora_rank={text_cfg.kv_lora_rank}) is not "
                "supported by OscarCache: Transformers caches the compressed latent and rebuilds keys and values from "
                "it, and OSCAR's rotations are per KV head of the keys and values")
        if is_model and any(isinstance(getattr(mod, "sinks", None), torch.Tensor) for mod in model_or_config.modules()):
            raise NotImplementedError(f"{fp.architecture}: attention sinks (a learned sink logit per query head, "
                                      "s_aux) are not supported by OscarCache's attention yet")
        for name in ("softcap", "attn_logit_softcapping"):
            if getattr(text_cfg, name, None):
                raise NotImplementedError(f"{fp.architecture}: attention logit soft-capping ({name}) is not supported by OSCAR")
        skipped = config.skipped(fp.num_layers)
        fp_heads = resolve_full_precision_heads(config, rotations, fp, skipped)
        if fp_heads:  # the saved / reported config names the heads, not "the top k"
            config = config.replace(full_precision_heads=tuple(sorted((i, h) for i, hs in fp_heads.items() for h in hs)))
        # a layer whose every head is exact is Transformers' own layer; at INT4 / INT8 it stays an OSCAR layer with
        # no INT2 head, so that it keeps the stored form (and the bits) it was chosen at
        exact_layers = {i for i, hs in fp_heads.items()
                        if len(hs) == fp.num_key_value_heads and config.full_precision_bits == 16}
        self.compiled = self._compiled_storage(compile, model_or_config if is_model else None, fp, rotations, skipped,
                                               exact_layers)
        layers: list[Any] = []
        for i, kind in enumerate(fp.layer_types):
            if kind in SLIDING_LAYER_TYPES:
                window = getattr(text_cfg, "sliding_window", None) if kind == "sliding_attention" else text_cfg.attention_chunk_size
                layers.append(self._sliding_layer(window))
            elif kind in STATE_LAYER_TYPES:  # no per-token K/V: Transformers' own state layer (compileable as it is)
                layers.append(LinearAttentionLayer(number_of_states=getattr(text_cfg, "number_of_conv_states", 1)))
            elif kind in FULL_LAYER_TYPES:
                if i in skipped or i not in rotations.layers or i in exact_layers:
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
            if self.compiled:
                install_step_hook(model_or_config)  # host-side length and capacity growth around the compiled step
        enable_oscar(model_or_config)

    max_cache_len_fixed: int | None = None  # StaticOscarCache's capacity

    def _compiled_storage(self, compile, model, fp: ModelFingerprint, rotations, skipped, exact_layers) -> bool:
        """Whether the full-attention layers get device-resident storage (:class:`StaticOscarLayer`)."""
        if compile is False:
            return False
        why = None
        growable = self.max_cache_len_fixed is None
        if growable and any(i in skipped or i not in rotations.layers for i, k in enumerate(fp.layer_types)
                              if k in FULL_LAYER_TYPES):
            why = "layers kept in full precision (skip_layers, or layers without rotations)"
        elif growable and exact_layers:
            why = "a layer whose every KV head is a BF16 full-precision head (full_precision_bits=16)"
        elif model is not None and (getattr(model, "_tp_size", None) or 1) > 1:
            why = "tensor parallelism"
        if compile == "auto":
            on_cuda = model is not None and any(p.is_cuda for p in model.parameters())
            if on_cuda and why:
                logger.info("OscarCache: eager storage (the compiled decode step does not support %s)", why)
            elif on_cuda and growable and any(k in SLIDING_LAYER_TYPES + STATE_LAYER_TYPES for k in fp.layer_types):
                # compile=True serves them (Transformers' StaticSlidingWindowLayer / LinearAttentionLayer beside the
                # OSCAR layers, same tokens); not the default until its speed and first-call cost are measured on a GPU
                logger.info("OscarCache: eager storage for a model with sliding-window or linear-attention layers "
                            "(compile=True compiles it; not the default yet)")
                return False
            return on_cuda and why is None
        if why:
            raise ValueError(f"OscarCache(compile=True) does not support {why}")
        return True

    # Layer factories: eager (OscarLayer) or device-resident (StaticOscarLayer) storage.
    def _sliding_layer(self, window: int):
        if self.compiled:
            # a bounded buffer of the window's width, whatever the generation's length (crop refused once it rolls)
            return StaticSlidingWindowLayer(max_cache_len=self.max_cache_len_fixed or 2**62, sliding_window=window)
        return DynamicSlidingWindowLayer(sliding_window=window)

    def _full_precision_layer(self):
        return StaticLayer(max_cache_len=self.max_cache_len_fixed) if self.compiled else DynamicLayer()

    def _oscar_layer(self, config: OscarConfig, rotation: LayerRotation, layer_idx: int, fp_heads=()):
        if self.compiled:
            return StaticOscarLayer(config, rotation, layer_idx, self.max_cache_len_fixed, fp_heads)
        return OscarLayer(config, rotation, layer_idx, fp_heads)

    @classmethod
    def from_pretrained(cls, name_or_path, model, config: OscarConfig | None = None, *, preset: str | None = None,
                        revision=None, cache_dir=None, local_files_only=False, token=None, **overrides) -> "OscarCache":
        """Load a rotation artifact (local dir or Hub repo id) and build a cache for ``model``."""
        rot = OscarRotations.from_pretrained(
            name_or_path, revision=revision, cache_dir=cache_dir, local_files_only=local_files_only, token=token
        )
        if config is None and preset is None and "group_size" not in overrides:
            # the group size the clips were chosen for: top level (hand-written artifacts) wins over where
            # calibrate() records it, metadata["calibration"]["group_size"]
            cal = rot.metadata.get("calibration")
            g = rot.metadata.get("group_size")
            if g is None and isinstance(cal, dict):
                g = cal.get("group_size")
            if g is not None:
                overrides["group_size"] = int(g)
        return cls(model, rot, config, preset=preset, **overrides)

    # ------------------------------------------------------------------ persistence
    def save(self, directory) -> None:
        """Write the live cache (INT2 history, windows, positions, rotations) to ``directory``."""
        save_cache(self, directory)

    @classmethod
    def load(cls, directory, model, device=None, compile: bool | str = "auto") -> "OscarCache":
        """Load a cache written by :meth:`save` to continue generation exactly where it stopped (into either storage,
        whichever wrote it: ``compile`` as in the constructor)."""
        return load_cache(cls, directory, model, device, compile=compile)

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
            elif getattr(layer, "is_initialized", False) and getattr(layer, "keys", None) is not None:
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
        # the history's average over the quantized layers' KV heads, full-precision heads at their stored bits
        q_layers = [layer for layer in self.layers if hasattr(layer, "memory")]
        n_heads = len(q_layers) * self.fingerprint.num_key_value_heads
        share = sum(len(layer.fp_heads) for layer in q_layers) / n_heads if n_heads else 0.0
        tot["history_bits_per_element"] = self.oscar_config.history_bits(self.fingerprint.head_dim, share)
        return tot

    def __repr__(self) -> str:
        n_q = sum(hasattr(layer, "memory") for layer in self.layers)
        c = self.oscar_config
        return (
            f"OscarCache(method={self.rotations.method!r}, quantized_layers={n_q}/{len(self.layers)}, sink={c.sink}, "
            f"recent={c.recent}, group_size={c.group_size}, seq_len={self.get_seq_length()})"
        )


class StaticOscarCache(OscarCache):
    """:class:`OscarCache` with device-resident storage of a fixed capacity: ``max_cache_len`` slots (prompt + new
    tokens, left padding included). ``OscarCache`` does the same on CUDA by itself, growing as needed; this class is
    for a known bound, and for models with sliding-window or ``skip_layers`` layers (Transformers'
    ``StaticSlidingWindowLayer`` / ``StaticLayer``). The batch size is taken from the first forward and fixed."""

    def __init__(self, model_or_config, rotations=None, config: OscarConfig | None = None, *, max_cache_len: int,
                 **overrides):
        if max_cache_len is None or int(max_cache_len) < 1:
            raise ValueError("StaticOscarCache needs max_cache_len >= 1 (prompt + new tokens, padding included)")
        if overrides.pop("compile", True) is not True:
            raise ValueError("StaticOscarCache is the compiled storage; use OscarCache(compile=False) for the eager one")
        self.max_cache_len_fixed = int(max_cache_len)  # (transformers 5.17's Cache has a read-only max_cache_len)
        super().__init__(model_or_config, rotations, config, compile=True, **overrides)

    @property
    def capacity(self) -> int:
        return self.max_cache_len_fixed

    @classmethod
    def load(cls, directory, model, device=None, *, max_cache_len: int | None = None) -> "StaticOscarCache":
        """Load a cache written by :meth:`save` (from either class) into a fixed capacity of ``max_cache_len`` slots:
        by default the saved StaticOscarCache's own, or the saved length plus headroom; a ``max_cache_len`` smaller
        than the saved length (left padding included) is a ValueError."""
        return load_cache(cls, directory, model, device, compile=True, fixed_capacity=True, max_cache_len=max_cache_len)

    def __repr__(self) -> str:
        return super().__repr__().replace("OscarCache(", f"StaticOscarCache(max_cache_len={self.capacity}, ", 1)
