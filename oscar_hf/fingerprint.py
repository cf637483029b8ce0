"""What an artifact was made for: :class:`ModelFingerprint`, each layer's kind as OSCAR sees it
(:func:`layer_types_of`), and the group size a head_dim takes (:func:`default_group_size`)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

from .quant import check_group_size

# Layer kinds. FULL: OSCAR quantizes it (a "hybrid" layer's attention too). SLIDING: Transformers' own layer.
FULL_LAYER_TYPES = ("full_attention",)
SLIDING_LAYER_TYPES = ("sliding_attention", "chunked_attention")
# Layers with a recurrent or convolution state and no per-token K/V: Transformers' own state layer, untouched.
STATE_LAYER_TYPES = ("linear_attention", "conv")
# Full attention kept in Transformers' own full-precision layer, for the reason OscarCache logs (FULL_PRECISION_WHY)
LATENT_LAYER_TYPE = "latent_attention"
SHARED_KV_LAYER_TYPE = "shared_kv_attention"
UNEQUAL_KV_LAYER_TYPE = "unequal_kv_attention"
FULL_PRECISION_LAYER_TYPES = (LATENT_LAYER_TYPE, SHARED_KV_LAYER_TYPE, UNEQUAL_KV_LAYER_TYPE)
FULL_PRECISION_WHY = {
    LATENT_LAYER_TYPE: "multi-head latent attention: Transformers caches the latent and expands it through kv_b_proj "
                       "at every step, so an INT2 latent would need a full-precision copy of its history every step; "
                       "the latent is already ~71x smaller than per-head keys and values",
    SHARED_KV_LAYER_TYPE: "KV sharing: later layers attend again to the keys and values this layer's cache returns",
    UNEQUAL_KV_LAYER_TYPE: "keys and values of different head sizes: OSCAR's INT2 storage and decode kernels pair one "
                           "head_dim for both"}
# Layers that cache nothing: the "reuse" layers of KV sharing, MoE / MLP-only layers (Transformers' DummyLayer).
DUMMY_LAYER_TYPE = "dummy"
# Transformers' legacy names (remap_legacy_layer_types) and the attention kind of its "hybrid" layers
_LAYER_TYPE_ALIASES = {"mamba": "linear_attention", "attention": "full_attention", "moe": DUMMY_LAYER_TYPE,
                       "mlp": DUMMY_LAYER_TYPE, "hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}


@dataclasses.dataclass(frozen=True)
class ModelFingerprint:
    """The shape facts an artifact depends on, read from a model's text config."""

    architecture: str
    model_type: str
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    name_or_path: str = ""

    @classmethod
    def from_config(cls, config) -> "ModelFingerprint":
        """``head_dim`` / ``num_key_value_heads`` are those of the layers OSCAR quantizes (Gemma 4 has its own)."""
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = layer_types_of(cfg)
        first = next((i for i, t in enumerate(types) if t in FULL_LAYER_TYPES), 0)
        n_heads = int(cfg.num_attention_heads)
        n_kv = int(_layer_attr(cfg, first, "num_key_value_heads") or n_heads)
        head_dim = _layer_attr(cfg, first, "head_dim") or cfg.hidden_size // n_heads
        archs = getattr(config, "architectures", None) or getattr(cfg, "architectures", None) or []
        return cls(architecture=archs[0] if archs else type(cfg).__name__.replace("Config", "ForCausalLM"),
                   model_type=str(getattr(cfg, "model_type", "")), num_layers=int(cfg.num_hidden_layers),
                   num_attention_heads=n_heads, num_key_value_heads=n_kv, head_dim=int(head_dim),
                   layer_types=tuple(types), name_or_path=str(getattr(config, "_name_or_path", "") or ""))

    def mismatches(self, other: "ModelFingerprint") -> list[str]:
        """Human-readable differences that make an artifact unusable (the name is informative only)."""
        return [f"{f}: artifact has {getattr(self, f)!r}, model has {getattr(other, f)!r}"
                for f in ("model_type", "num_layers", "num_attention_heads", "num_key_value_heads", "head_dim")
                if getattr(self, f) != getattr(other, f)]

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "layer_types": list(self.layer_types)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelFingerprint":
        try:
            return cls(**{**d, "layer_types": tuple(d.get("layer_types", ()))})
        except TypeError as e:
            raise ValueError(f"corrupted model fingerprint in artifact: {json.dumps(d)[:200]} ({e})") from None


def _layer_attr(cfg, i: int, name: str):
    """``cfg.<name>`` as layer ``i`` sees it (Gemma 4: ``per_layer_config``, whose global attribute raises), or None."""
    try:
        return getattr(cfg.per_layer_config[i], name, None)
    except (AttributeError, IndexError, KeyError, TypeError):  # no per_layer_config (older Transformers, plain objects)
        try:
            return getattr(cfg, name, None)
        except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
            return None


def kv_sharing_modes(cfg) -> list[str | None] | None:
    """Per layer ``"store"`` (later layers reuse its K/V), ``"reuse"`` (caches nothing) or None; None without KV
    sharing. Older Transformers derive it in the model (the last ``num_kv_shared_layers`` layers reuse the last
    earlier layer of their type), as here."""
    modes = getattr(cfg, "kv_sharing_modes", None)
    if modes is not None:
        return list(modes)
    shared = int(getattr(cfg, "num_kv_shared_layers", 0) or 0)
    types = getattr(cfg, "layer_types", None)
    if shared <= 0 or types is None:
        return None
    n = int(cfg.num_hidden_layers)
    first = n - shared
    modes = [None if i < first else "reuse" for i in range(n)]
    for t in set(types[first:]):
        if t in types[:first]:
            modes[first - 1 - types[:first][::-1].index(t)] = "store"
    return modes


def layer_types_of(cfg) -> list[str]:
    """Per-layer kind as OSCAR sees it (the constants above), from Transformers' ``layer_types`` (inferred as its
    caches do when absent), legacy names mapped."""
    n = int(cfg.num_hidden_layers)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        types = [("sliding_attention" if getattr(cfg, "sliding_window", None) is not None
                  else "chunked_attention" if getattr(cfg, "attention_chunk_size", None) is not None
                  else "full_attention")] * n
    types = [_LAYER_TYPE_ALIASES.get(t, t) for t in types]
    if (modes := kv_sharing_modes(cfg)) is not None:
        reused = {t for t, m in zip(types, modes) if m == "reuse"}
        types = [DUMMY_LAYER_TYPE if m == "reuse"
                 else SHARED_KV_LAYER_TYPE if m == "store" and t in reused and t in FULL_LAYER_TYPES else t
                 for t, m in zip(types, modes)]
    if getattr(cfg, "kv_lora_rank", None):  # MLA: every attention layer caches the latent
        types = [LATENT_LAYER_TYPE if t in FULL_LAYER_TYPES else t for t in types]
    elif getattr(cfg, "v_head_dim", None) is not None and cfg.v_head_dim != getattr(cfg, "head_dim", None):
        # (head_dim read only then: a heterogeneous config such as Gemma 4's raises on the global value)
        types = [UNEQUAL_KV_LAYER_TYPE if t in FULL_LAYER_TYPES else t for t in types]
    return types


def hybrid_state_layers(cfg) -> set[int]:
    """Layers that are attention and an SSM state in one (Falcon-H1, Zamba): their cache layer holds both."""
    return {i for i, t in enumerate(getattr(cfg, "layer_types", None) or ()) if t in ("hybrid", "hybrid_sliding")}


def default_group_size(head_dim: int) -> int:
    """64 where it divides ``head_dim``; else the largest whole number of planes (``head_dim / 4``, what the
    kernels' fast loop reads under one scale) up to 64 (48 at 96); else one group per head."""
    if head_dim % 64 == 0:
        return 64
    plane = head_dim // 4
    return next((g for g in (head_dim, 2 * plane, plane) if 0 < g <= 64 and head_dim % g == 0), head_dim)


def validate_head_dim(fp: ModelFingerprint, group_size: int | None) -> None:
    """Raise ValueError naming the model when ``group_size`` (None: ``head_dim``) cannot group its quantized heads."""
    if not any(t in FULL_LAYER_TYPES for t in fp.layer_types):  # MLA-only models quantize nothing
        return
    try:
        check_group_size(fp.head_dim, fp.head_dim if group_size is None else group_size)
    except ValueError as e:
        raise ValueError(f"{fp.architecture}: {e}") from None
