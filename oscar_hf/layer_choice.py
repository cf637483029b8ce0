"""Which layers OSCAR quantizes, and how: :func:`choose_layers`, one pure function shared by the caches, the
serving store and the eval methods. In order: rotations -> fingerprint -> group size -> skipped layers -> retrieval
heads -> exact layers (every KV head a 16-bit retrieval head: Transformers' own layer keeps it).
"""
from __future__ import annotations

import dataclasses
import logging
import warnings

from .config import FULL_LAYER_TYPES, ModelFingerprint, OscarConfig, artifact_settings, validate_head_dim
from .rotations import OscarRotations, ranked_heads

logger = logging.getLogger("oscar_hf")


class WindowsWarning(UserWarning):
    """A cache keeps smaller sink / recent windows than its artifact chose: quality no fluency metric shows is lost."""


@dataclasses.dataclass(frozen=True)
class LayerChoice:
    """What :func:`choose_layers` decided for one model; a cache builds its layers from it."""

    config: OscarConfig  # group size resolved at head_dim; the retrieval heads named as (layer, kv_head) pairs
    rotations: OscarRotations
    fingerprint: ModelFingerprint
    skipped: frozenset[int]  # skip_layers, as non-negative layer indices
    retrieval_heads: dict[int, tuple[int, ...]]  # {layer: kv heads}, quantized layers only
    exact: frozenset[int]  # layers whose every KV head is a 16-bit retrieval head: Transformers' own layer

    def quantized(self, i: int) -> bool:
        """Whether layer ``i`` gets an OSCAR layer: full attention, with a rotation, neither skipped nor exact."""
        return _rotated(self.fingerprint, self.rotations, self.skipped, i) and i not in self.exact

    @property
    def quantized_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.fingerprint.num_layers) if self.quantized(i))

    @property
    def kept_full_attention(self) -> frozenset[int]:
        """Full-attention layers kept in full precision (skipped, without a rotation, or exact)."""
        return frozenset(i for i, t in enumerate(self.fingerprint.layer_types)
                         if t in FULL_LAYER_TYPES and not self.quantized(i))


def _rotated(fp: ModelFingerprint, rotations: OscarRotations, skipped, i: int) -> bool:
    """Whether layer ``i`` is a full-attention layer with a rotation, not skipped (quantized unless exact)."""
    return fp.layer_types[i] in FULL_LAYER_TYPES and i not in skipped and i in rotations.layers


def choose_layers(model_config, rotations: OscarRotations | None, config: OscarConfig, *,
                  default_group: bool = False) -> LayerChoice:
    """The layer choice for a model (or its config) under ``config``; ``rotations`` None: ``config.method``'s
    built-in ones. ``default_group``: as :meth:`OscarConfig.for_head_dim`. Warns on a group size other than the
    calibrated one, missing rotations, or windows smaller than the artifact's (:class:`WindowsWarning`)."""
    model_config = getattr(model_config, "config", model_config)
    if rotations is None:
        rotations = OscarRotations.builtin(model_config, config.method)
    else:
        rotations.check_compatible(model_config)
    fp = ModelFingerprint.from_config(model_config)
    config = config.for_head_dim(fp.head_dim, default_group=default_group)
    validate_head_dim(fp, config.group_size)
    cal_g = rotations.metadata.get("group_size")
    if cal_g is not None and int(cal_g) != config.group_size:
        logger.warning("rotations were calibrated for group_size=%s, cache uses %s", cal_g, config.group_size)
    if short := window_shortfall(config, rotations):
        warnings.warn(f"OSCAR windows are smaller than the artifact's: {short}. Build the cache with "
                      "OscarCache.from_pretrained(artifact, model) and no config, or pass the artifact's sink / recent.",
                      WindowsWarning, stacklevel=3)
    skipped = config.skipped(fp.num_layers)
    _warn_missing_rotations(fp, rotations, skipped)
    heads = resolve_retrieval_heads(config, rotations, fp, skipped)
    if heads:  # the saved / reported config names the heads, not "the top k"
        config = config.replace(retrieval_heads=tuple(sorted((i, h) for i, hs in heads.items() for h in hs)))
    # a layer whose every head is exact is Transformers' own layer; at INT4 / INT8 it stays an OSCAR layer with no
    # INT2 head, so that it keeps the stored form (and the bits) it was chosen at
    exact = frozenset(i for i, hs in heads.items()
                      if len(hs) == fp.num_key_value_heads and config.retrieval_bits == 16)
    return LayerChoice(config, rotations, fp, frozenset(skipped), heads, exact)


def chosen_windows(rotations: OscarRotations | None, config: OscarConfig) -> tuple[int, int] | None:
    """``(sink, recent)`` the artifact chose (one it did not choose is ``config``'s), or None."""
    chosen = artifact_settings(rotations.metadata) if rotations is not None else None
    return (chosen.get("sink", config.sink), chosen.get("recent", config.recent)) if chosen else None


def window_shortfall(config: OscarConfig, rotations: OscarRotations | None) -> str | None:
    """A sentence when ``config``'s windows are smaller than the ones the artifact chose, else None."""
    want = chosen_windows(rotations, config)
    have = (config.sink, config.recent)
    if want is None or (have[0] >= want[0] and have[1] >= want[1]):
        return None
    return (f"the cache keeps sink {have[0]} / recent {have[1]} tokens in full precision, but its artifact chose sink "
            f"{want[0]} / recent {want[1]} (it was calibrated and scored with them)")


def resolve_retrieval_heads(config: OscarConfig, rotations: OscarRotations, fp: ModelFingerprint,
                            skipped: set[int]) -> dict[int, tuple[int, ...]]:
    """``{layer: kv heads}`` kept out of the INT2 history (``OscarConfig.retrieval_heads`` says how they are chosen),
    checked against the model; heads of unquantized layers are left out."""
    want = config.retrieval_heads
    if want == "auto":
        # the quantized layers' KV heads: the ones the INT2 history (and the bit budget) is about
        quantized = [i for i in sorted(rotations.layers)
                     if 0 <= i < fp.num_layers and _rotated(fp, rotations, skipped, i)]
        scores = rotations.retrieval_scores
        if scores is None:
            logger.info("retrieval heads 'auto': the %s rotations have no retrieval scores, no retrieval heads",
                        rotations.method)
            pairs = ()
        else:
            n_heads = len(quantized) * fp.num_key_value_heads
            budget = config.retrieval_head_budget(fp.head_dim, n_heads)
            passing = [p for p in ranked_heads(scores, quantized) if scores[p] >= config.retrieval_threshold]
            pairs = tuple(passing[:budget])
            logger.info("retrieval heads 'auto': %d of %d heads score >= %.2f, budget %d (history <= %.2f bits): %s",
                        len(passing), n_heads, config.retrieval_threshold, budget, config.max_history_bits,
                        list(pairs))
    else:
        pairs = rotations.top_retrieval_heads(want) if isinstance(want, int) else want
    out: dict[int, list[int]] = {}
    for i, h in pairs:
        if not 0 <= i < fp.num_layers or not 0 <= h < fp.num_key_value_heads:
            raise ValueError(f"retrieval heads: ({i}, {h}) is not a (layer, kv_head) of this model "
                             f"({fp.num_layers} layers, {fp.num_key_value_heads} KV heads)")
        if _rotated(fp, rotations, skipped, i):
            out.setdefault(i, []).append(h)
    return {i: tuple(sorted(hs)) for i, hs in out.items()}


_SAID_MISSING: set[tuple] = set()  # (architecture, missing layers) already warned about


def _warn_missing_rotations(fp: ModelFingerprint, rotations: OscarRotations, skipped) -> None:
    """Warn once per model and set of layers about full-attention layers left unquantized for want of a rotation."""
    missing = tuple(i for i, t in enumerate(fp.layer_types)
                    if t in FULL_LAYER_TYPES and i not in skipped and i not in rotations.layers)
    if missing and (fp.architecture, missing) not in _SAID_MISSING:
        _SAID_MISSING.add((fp.architecture, missing))
        logger.warning("OscarCache: the rotation artifact has no rotation for full-attention layer%s %s of %s: %s "
                       "stay%s unquantized, in the model's dtype (BF16), not INT2", "s" * (len(missing) > 1),
                       ", ".join(map(str, missing)), fp.name_or_path or fp.architecture,
                       "they" if len(missing) > 1 else "it", "" if len(missing) > 1 else "s")
