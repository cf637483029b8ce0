"""What an :class:`~oscar_hf.OscarCache` holds, for people: layer kinds, the construction log line, bytes by part."""
from __future__ import annotations

import logging

from transformers.cache_utils import LinearAttentionCacheLayerMixin

from ..config import DUMMY_LAYER_TYPE, FULL_PRECISION_WHY, SLIDING_LAYER_TYPES, STATE_LAYER_TYPES
from .compiled import CompiledOscarLayer
from .dynamic import OscarLayer
from .growing import GrowingLayer

logger = logging.getLogger("oscar_hf")
_SAID: set[tuple[str, str]] = set()  # (architecture, layer kind) whose full-precision reason was logged


def layer_kinds(cache) -> list[str]:
    """What each decoder layer got: ``"oscar"`` / ``"oscar+state"``, ``"sliding"``, ``"state"``, ``"latent"``,
    ``"shared_kv"``, ``"full_precision"`` (skipped, no rotation) or ``"none"`` (caches nothing)."""
    named = {"latent_attention": "latent", "shared_kv_attention": "shared_kv", DUMMY_LAYER_TYPE: "none",
             **dict.fromkeys(SLIDING_LAYER_TYPES, "sliding"), **dict.fromkeys(STATE_LAYER_TYPES, "state")}
    out = []
    for i, t in enumerate(cache.fingerprint.layer_types):
        layer = cache.layers[i] if i < len(cache.layers) else None
        if isinstance(layer, (OscarLayer, CompiledOscarLayer)):
            out.append("oscar+state" if isinstance(layer, LinearAttentionCacheLayerMixin) else "oscar")
        else:  # full attention (skipped, no rotation, exact) and unequal K/V widths: "full_precision"
            out.append(named.get(t, "full_precision"))
    return out


def log_layer_plan(cache, hybrid: set[int]) -> None:
    """Log which attention layers stay in full precision and why, one line per reason (a warning when nothing is
    quantized; debug after the first cache of the architecture)."""
    fp = cache.fingerprint
    kinds = layer_kinds(cache)
    n_q = sum(k.startswith("oscar") for k in kinds)
    for kind, why in FULL_PRECISION_WHY.items():
        idx = [i for i, t in enumerate(fp.layer_types) if t == kind]
        if idx:
            first = (fp.architecture, kind) not in _SAID
            _SAID.add((fp.architecture, kind))
            level = (logging.WARNING if n_q == 0 else logging.INFO) if first else logging.DEBUG
            logger.log(level, "OscarCache: %d of %d layers of %s kept in full precision (Transformers' own layer, "
                       "%s storage), %d quantized: %s", len(idx), fp.num_layers, fp.architecture,
                       "compiled" if cache.compiled else "eager", n_q, why)
    if hybrid and n_q:
        logger.debug("OscarCache: %d hybrid layers of %s: OSCAR attention beside Transformers' linear-attention / "
                     "SSM state", len(hybrid), fp.architecture)


def memory_report(cache) -> dict[str, float]:
    """Bytes by part (summed over layers), bits per element, and the BF16 equivalent. ``full_precision_layers``:
    bytes of Transformers' own layers; ``*_layers`` counts: layers of each kind."""
    tot = dict.fromkeys(("sink", "recent", "history_codes", "history_meta", "history_elements", "retrieval_heads",
                         "allocated", "full_precision_layers"), 0)
    elements = 0
    for layer in cache.layers:
        if hasattr(layer, "memory"):  # OscarLayer and the compiled CompiledOscarLayer
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
    kinds = layer_kinds(cache)
    tot["quantized_layers"] = sum(k.startswith("oscar") for k in kinds)
    tot["latent_layers"] = kinds.count("latent")
    tot["shared_kv_layers"] = kinds.count("shared_kv")
    used = (tot["sink"] + tot["recent"] + tot["history_codes"] + tot["history_meta"] + tot["full_precision_layers"]
            + tot["retrieval_heads"])
    tot["total"] = used
    tot["bf16_equivalent"] = 2 * elements
    tot["bits_per_element"] = 8 * used / elements if elements else float("nan")
    tot["compression_vs_bf16"] = tot["bf16_equivalent"] / used if used else float("nan")
    # the history's average over the quantized layers' KV heads, retrieval heads at their stored bits
    q_layers = [layer for layer in cache.layers if hasattr(layer, "memory")]
    n_heads = len(q_layers) * cache.fingerprint.num_key_value_heads
    share = sum(len(layer.retrieval_heads) for layer in q_layers) / n_heads if n_heads else 0.0
    tot["history_bits_per_element"] = cache.oscar_config.history_bits(cache.fingerprint.head_dim, share)
    return tot
